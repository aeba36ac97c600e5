"""The source scan behind ``config_reads``: which config attributes a transformers modeling module's classes read
(``config.X``, ``getattr(config, "X", fallback)``, ``hasattr(config, "X")``, with the fallback expressions), and
which ``self.X`` a config class's own code reads."""

from __future__ import annotations

import ast
import contextlib
import inspect

MISSING = object()  # an attribute a class does not have


def config_fields(cls: type) -> frozenset[str]:
    """The config class's keys (its dataclass fields, class variables left out)."""
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()


def plumbing(cls: type, name: str) -> bool:
    """A method or class-level table of the config class (``to_dict``, ``base_model_tp_plan``), not a key."""
    if name.startswith("__"):
        return True
    fields = config_fields(cls)
    attr = inspect.getattr_static(cls, name, MISSING)
    if attr is MISSING or name in fields:
        return False
    return callable(attr) or isinstance(attr, (dict, list, tuple, staticmethod, classmethod))


def _is_config(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "config" or node.id.endswith("_config")
    if isinstance(node, ast.Attribute):
        return node.attr == "config" or node.attr.endswith("_config")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "get_text_config"
    return False


def _getattr_site(node: ast.AST) -> tuple[str, ast.AST | None] | None:
    """``getattr(config, "X"[, fallback])`` or ``hasattr(config, "X")``: (X, fallback or None)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2 and _is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        fallback = node.args[2] if node.func.id == "getattr" and len(node.args) > 2 else None
        return node.args[1].value, fallback
    return None


def scan_module(module, classes: set[str]) -> tuple[set[str], dict[str, list[str]]]:
    """Config attributes read in ``module``'s classes named ``classes`` and its module-level functions; with the
    fallback expressions of ``getattr`` reads (``getattr(config, "head_dim", None) or hidden // heads`` -> the
    right-hand side)."""
    tree = ast.parse(inspect.getsource(module))
    scopes = [n for n in tree.body if (isinstance(n, ast.ClassDef) and n.name in classes)
              or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    reads: set[str] = set()
    fallbacks: dict[str, list[str]] = {}
    for scope in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_config(node.value):
                reads.add(node.attr)
            elif (site := _getattr_site(node)) is not None:
                reads.add(site[0])
                fallback = site[1]
                if isinstance(fallback, ast.Constant) and fallback.value is None:
                    fallback = None  # `getattr(..., None) or EXPR` is caught below
                if fallback is not None:
                    fallbacks.setdefault(site[0], []).append(ast.unparse(fallback))
            elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
                site = _getattr_site(node.values[0])
                if site is not None and (site[1] is None or (isinstance(site[1], ast.Constant)
                                                             and site[1].value is None)):
                    fallbacks.setdefault(site[0], []).append(ast.unparse(node.values[1]))
    return reads, {k: sorted(set(v)) for k, v in fallbacks.items()}


def scan_config_class(cls: type) -> frozenset[str]:
    """``self.X`` read by the config class's own code and its transformers bases (``__post_init__``, properties,
    RoPE standardization): keys it may derive from."""
    reads: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers."):
            with contextlib.suppress(OSError, TypeError):
                for node in ast.walk(ast.parse(inspect.getsource(klass).strip())):
                    if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                            and isinstance(node.value, ast.Name) and node.value.id == "self"):
                        reads.add(node.attr)
    return frozenset(r for r in reads if not plumbing(cls, r))
