"""Release recipes: the schema accepts the examples in recipes/, turns gates into verify's, and refuses a
bad recipe with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tuneport.convert.errors import UserError
from tuneport.toolkit.recipe import load_recipe, parse_recipe, resolve_local

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
GOOD = """
name: tiny
version: 0.1.0
base: {path: ./base}
adapters: [{name: chat, path: ./chat}, {name: style, path: ./style, weight: 0.5}]
targets:
  - {type: gguf, quant: [q8_0, q4_0], adapters: separate}
  - {type: vllm}
  - {type: safetensors, dtype: bf16}
gates: {kl: {default: 0.5, q8_0: 0.02}, top1: 0.8, chat_template: false}
publish: {repo: org/tiny, tag: v0.1.0}
"""


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_examples_parse(path):
    recipe, digest = load_recipe(path)
    assert recipe.targets and len(digest) == 64


def test_good_recipe_and_its_gates():
    r = parse_recipe(GOOD)
    assert [t.type for t in r.targets] == ["gguf", "vllm", "safetensors"]
    assert r.targets[1].adapters == "separate" and r.targets[2].dtype == "bf16" and r.publish.private
    assert r.gates.for_artifact("q8_0") == ["kl<=0.02", "top1>=0.8", "strength_error<=0.1", "tokenizer",
                                            "special_tokens"]
    assert r.gates.for_artifact("q4_0")[0] == "kl<=0.5" and r.gates.for_artifact(None)[0] == "kl<=0.5"


def test_mlx_target_options():
    r = parse_recipe(GOOD.replace("{type: vllm}", "{type: mlx, quant: q4, group_size: 32, adapters: separate}")
                     .replace("{type: safetensors, dtype: bf16}", "{type: mlx, quant: none, dtype: bf16}"))
    q4, plain = r.targets[1], r.targets[2]
    assert (q4.type, q4.quant, q4.group_size, q4.adapters, q4.dtype) == ("mlx", "q4", 32, "separate", "auto")
    assert (plain.quant, plain.group_size, plain.adapters, plain.dtype) == (None, None, "merge", "bf16")


@pytest.mark.parametrize(("change", "says"), [
    (("q4_0]", "q9_k]"), "targets[0].quant: 'q9_k' is not a GGUF type"),
    (("type: vllm", "type: exl2"),
     "targets[1]: type 'exl2' is not a target (allowed: gguf, vllm, safetensors, awq, mlx, exl3)"),
    (("{type: vllm}", "{type: exl3, bits: 9}"), "targets[1].bits: Input should be less than or equal to 8"),
    (("{type: vllm}", "{type: exl3, codebook: e8p}"), "targets[1].codebook: Input should be 'mul1', 'mcg' or"),
    (("{type: vllm}", "{type: exl3, head_bits: 2.5, codebook: 3inst}"),
     "targets[1]: head_bits 2.5 needs codebook mul1"),
    (("{type: vllm}", "{type: mlx, quant: q9}"), "targets[1].quant: Input should be 'q2', 'q3', 'q4'"),
    (("{type: vllm}", "{type: mlx, group_size: 32}"), "targets[1]: group_size applies with a quant type"),
    (("{type: vllm}", "{type: mlx, quant: mxfp4, group_size: 64}"),
     "targets[1]: group_size 64: mxfp4 always uses groups of 32: drop group_size"),
    (("{type: vllm}", "{type: mlx, quant: q4, group_size: 48}"),
     "targets[1].group_size: Input should be 32, 64 or 128"),
    (("version: 0.1.0\n", ""), "version: missing key"),
    (("tag: v0.1.0", "tga: v0.1.0"), "publish.tga: unknown key"),
    (("adapters: separate", "adapters: both"), "targets[0].adapters: Input should be 'merge' or 'separate'"),
    (("name: chat,", "name: 'a b',"), "adapters[0].name: String should match pattern"),
    (("q8_0: 0.02", "q9: 0.02"), "gates.kl: 'q9' is neither 'default' nor a GGUF type"),
    (("name: style", "name: chat"), "adapter names must differ"),
    (("top1: 0.8", "top1: 2"), "gates.top1: Input should be less than or equal to 1"),
    (("repo: org/tiny", "repo: tiny"), "publish.repo: String should match pattern"),
    (("name: tiny", "name: ["), "is not valid YAML at line 4, column 5"),
])
def test_bad_recipes_name_the_key(change, says):
    with pytest.raises(UserError) as e:
        parse_recipe(GOOD.replace(*change), "r.yaml")
    assert says in e.value.line() and e.value.exit_code == 2
    assert "\n" not in e.value.line()


def test_not_a_mapping_and_unreadable(tmp_path):
    with pytest.raises(UserError, match="must be a YAML mapping"):
        parse_recipe("- a\n- b\n")
    with pytest.raises(UserError, match="cannot read the recipe"):
        load_recipe(tmp_path / "none.yaml")


def test_paths_resolve_beside_the_recipe(tmp_path):
    (tmp_path / "base").mkdir()
    recipe = tmp_path / "r.yaml"
    assert resolve_local(recipe, "./base") == str((tmp_path / "base").resolve())
    assert resolve_local(recipe, "org/model") == "org/model"


def test_ci_template_runs_the_release():
    workflow = yaml.safe_load((Path(__file__).parent.parent / "recipes" / "github-actions-release.yml").read_text())
    runs = [s.get("run", "") for s in workflow["jobs"]["release"]["steps"]]
    assert any("tuneport release" in r and "--push" not in r for r in runs)
    assert any("--push --dry-run" in r for r in runs) and any(r.endswith("--push") for r in runs)
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in workflow["jobs"]["release"]["steps"])
