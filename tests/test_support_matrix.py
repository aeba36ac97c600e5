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
    for test in target.tests:
        assert parametrized_archs(test) == set(supported(target.key)), test


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
