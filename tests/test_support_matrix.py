"""The support matrix is the tests' source: every column's parity tests are parametrized with exactly the
architectures the table says the target exports, every architecture has a tiny model, and
docs/architectures.md is what the generator writes today."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tuneport.convert.arch import ARCHS
from tuneport.convert.support_matrix import COLUMNS, supported
from tuneport.toolkit.arch_docs import DOC, render
from tuneport.toolkit.tiny import TINY_ARCHS

TESTS = Path(__file__).resolve().parent


def parametrized_archs(test: str) -> set[str]:
    path, func = test.split("::")
    sys.path.insert(0, str(TESTS))
    module = importlib.import_module(Path(path).stem)
    archs: set[str] = set()
    for mark in getattr(getattr(module, func), "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "arch" in names:
            i = names.index("arch")
            archs |= {v if len(names) == 1 else v[i] for v in values}
    return archs


@pytest.mark.parametrize("target", COLUMNS, ids=[f"{t.key}-column" for t in COLUMNS])
def test_every_column_is_tested_on_every_architecture_it_claims(target):
    """The column's tests, together, run every architecture it claims (and no other)."""
    covered = set().union(*(parametrized_archs(test) for test in target.tests))
    assert covered == set(supported(target.key)), target.tests


def test_every_architecture_has_a_tiny_model():
    from tuneport.convert.support_matrix import NOT_YET

    assert set(ARCHS) <= set(TINY_ARCHS), set(ARCHS) - set(TINY_ARCHS)
    assert not set(NOT_YET) & set(ARCHS), "an architecture with an entry is still listed as not supported yet"


def test_docs_architectures_is_generated_from_the_tables():
    assert DOC.read_text() == render(), "docs/architectures.md is stale: python -m tuneport.toolkit.arch_docs --write"


@pytest.mark.parametrize("target", [t.key for t in COLUMNS if t.key not in ("merge", "vllm")])
def test_every_refused_cell_is_refused_by_the_export_with_its_reason(zoo, target):
    """A cell's reason is what `export --target` says (the base check, before any work)."""
    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.convert.errors import UserError
    from tuneport.convert.support_matrix import cell
    from tuneport.convert.targets import check_base

    for model_type in ARCHS:
        why = cell(target, model_type)
        if why is None:
            continue
        with pytest.raises(UserError) as e:
            check_base(Checkpoint(zoo.base(model_type)), target)
        assert why in str(e.value), (model_type, str(e.value))


def test_each_architecture_is_one_module_and_every_target_table_a_view_of_it():
    """Adding an architecture is one module of convert/arch (plus its tiny model): each module holds the entry of
    the model_type it is named after, and the per-target tables hold that entry's facts, not facts of their own."""
    import pkgutil

    import tuneport.convert.arch as package
    from tuneport.convert.calibration.archs import AWQ_ARCHS
    from tuneport.convert.exl3.converter import EXL3_ARCHS
    from tuneport.convert.gguf.config_keys import GGUF_CONFIG_RULES
    from tuneport.convert.gguf.model import GGUF_ARCHS
    from tuneport.convert.mlx.archs import MLX_ARCHS
    from tuneport.convert.multimodal import TEXT_TOWERS

    modules = {m.name for m in pkgutil.iter_modules(package.__path__)} - package.NOT_ENTRIES
    assert modules == set(ARCHS)
    for model_type, arch in ARCHS.items():
        assert importlib.import_module(f"tuneport.convert.arch.{model_type}").ARCH is arch
        assert GGUF_ARCHS.get(model_type) is arch.gguf and MLX_ARCHS.get(model_type) is arch.mlx
        assert AWQ_ARCHS.get(model_type) is arch.awq and TEXT_TOWERS.get(model_type) is arch.text_tower
        assert (model_type in EXL3_ARCHS) == arch.exl3
        assert GGUF_CONFIG_RULES.get(model_type) == (dict(arch.gguf.config_rules) if arch.gguf else None)
        for target in arch.refusals:
            assert not getattr(arch, target, None), f"{model_type}: a refusal for {target}, which its entry exports"
