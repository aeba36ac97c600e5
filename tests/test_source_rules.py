"""Rules of the source tree, checked on the source itself (ast and text, nothing imported):

- nothing imports the repository's folders by their bare names (``convert``, ``serve``, ``toolkit``);
- imports only point down the floors: convert <- serve <- toolkit, with the ``tuneport`` API on top;
- no import cycle among the modules of a floor (lazy imports inside functions count: they hide a cycle, not
  remove it);
- no run of 6+ lines is repeated across convert/, serve/ and toolkit/ (one piece of code per job).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = {"convert": 0, "serve": 1, "toolkit": 2}  # tuneport/ (the public API) stands above them all
BARE = set(FLOORS)
CHECKED = ("convert", "serve", "toolkit", "tuneport", "tests", "benchmarks")


def package_of(path: Path, root: Path = REPO) -> list[str]:
    """The dotted package a source file lives in, as installed (``convert/gguf/x.py`` -> tuneport.convert.gguf)."""
    rel = path.relative_to(root).parts
    return ["tuneport", *rel[:-1]] if rel[0] in FLOORS else list(rel[:-1])


def imports(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, lazy ones inside functions included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = package_of(path, root)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if mod == "tuneport"]
    return out


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_bare_imports_and_imports_point_down():
    problems = []
    for path in sources(*CHECKED):
        rel = path.relative_to(REPO)
        floor = FLOORS.get(rel.parts[0])
        for line, mod in imports(path):
            parts = mod.split(".")
            if parts[0] in BARE:
                problems.append(f"{rel}:{line}: bare import of {mod} (use tuneport.{mod})")
            if floor is None or parts[0] != "tuneport":
                continue
            target = parts[1] if len(parts) > 1 else None
            if target not in FLOORS and target != "__version__":
                problems.append(f"{rel}:{line}: {mod} is the public API, above every floor")
            elif target in FLOORS and FLOORS[target] > floor:
                problems.append(f"{rel}:{line}: {rel.parts[0]} imports {mod}, a floor above it")
    assert not problems, "\n".join(problems)


def test_the_import_reader_resolves_relative_and_lazy_imports(tmp_path):
    probe = tmp_path / "convert" / "gguf" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..serve import pool\nimport toolkit.cli\nfrom . import read\n\n\ndef f():\n"
                     "    import tuneport\n")
    found = imports(probe, tmp_path)
    assert (1, "tuneport.convert.serve") in found  # two dots from convert/gguf: tuneport.convert
    assert (2, "toolkit.cli") in found and (3, "tuneport.convert.gguf") in found and (7, "tuneport") in found


def module_file(name: str) -> Path | None:
    """The source file of an installed module name (``tuneport.convert.gguf`` -> convert/gguf/__init__.py)."""
    parts = name.split(".")
    if parts[0] != "tuneport" or len(parts) < 2 or parts[1] not in FLOORS:
        return None
    stem = REPO.joinpath(*parts[1:])
    for path in (stem.with_suffix(".py"), stem / "__init__.py"):
        if path.is_file():
            return path
    return None


def import_graph(*folders: str) -> dict[Path, set[Path]]:
    """Source file -> the floor files it imports (``from pkg import sub`` reaches the submodule ``sub``)."""
    graph: dict[Path, set[Path]] = {}
    for path in sources(*folders):
        tree, package, deps = ast.parse(path.read_text()), package_of(path), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(f for a in node.names if (f := module_file(a.name)))
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                mod = ".".join([*base, *([node.module] if node.module else [])])
                subs = [f for a in node.names if (f := module_file(f"{mod}.{a.name}"))]
                deps.update(subs or [f for f in [module_file(mod)] if f])
        graph[path] = deps - {path}
    return graph


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    out: list[list[Path]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_within_the_floors():
    found = cycles(import_graph("convert", "serve", "toolkit"))
    assert not found, "\n".join(" -> ".join(sorted(str(p.relative_to(REPO)) for p in c)) for c in found)


def test_the_cycle_finder():
    a, b, c = (Path(n) for n in ("a.py", "b.py", "c.py"))
    assert [set(x) for x in cycles({a: {b}, b: {c}, c: {a, b}})] == [{a, b, c}]
    assert cycles({a: {b}, b: {c}, c: set()}) == []
    graph = import_graph("convert")  # a lazy import inside a function is an edge: export.py -> export_hf.py
    assert REPO / "convert" / "export_hf.py" in graph[REPO / "convert" / "export.py"]


_SKIP = re.compile(r"^(#.*|[\s()\[\]{}:,]*|(from\s+\S+\s+)?import\s.*|\"\"\"|''')$")


def normalized_lines(path: Path) -> list[tuple[int, str]]:
    """Lines that carry code: blank lines, comments, lone punctuation and imports are passed over."""
    out = []
    for no, line in enumerate(path.read_text().splitlines(), start=1):
        text = " ".join(line.split())
        if text and not _SKIP.match(text):
            out.append((no, text))
    return out


def test_no_six_line_block_is_repeated_across_the_floors():
    window = 6
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path in sources("convert", "serve", "toolkit"):
        lines = normalized_lines(path)
        for i in range(len(lines) - window + 1):
            block = tuple(t for _, t in lines[i: i + window])
            seen[block].append((str(path.relative_to(REPO)), lines[i][0]))
    repeats = []
    for places in seen.values():
        distinct = [p for k, p in enumerate(places) if all(p[0] != q[0] or abs(p[1] - q[1]) >= window
                                                              for q in places[:k])]
        if len(distinct) > 1:
            repeats.append(" ~ ".join(f"{f}:{n}" for f, n in distinct))
    assert not repeats, "\n".join(repeats[:10])
