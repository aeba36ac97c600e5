"""The config audit for --target mlx: a key transformers' model reads and mlx-lm does not (its ModelArgs has no
such field), at a value that changes the model, is refused with the reason, exit 2 and nothing written; a key
transformers does not read is inert; what mlx-lm reads, or tuneport rewrites for it, passes (parity in
tests/test_mlx_export.py)."""

from __future__ import annotations

import json

import pytest

from tuneport.convert.mlx.archs import MLX_ARCHS
from tuneport.toolkit.tiny import make_base

pytest.importorskip("mlx_lm")

CASES = [  # (arch, config values the tiny model is built with, a piece of the refusal)
    ("llama", {"hidden_act": "gelu"}, "(hidden_act 'gelu' (without the key: 'silu')), and mlx-lm's llama does not "
                                      "read it"),
    ("qwen3", {"attention_bias": True}, "(attention_bias True (without the key: False)), and mlx-lm's qwen3 does "
                                        "not read it"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, "with full attention"),
    ("mixtral", {"sliding_window": 8}, "sliding window of 8 tokens"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True,
               "sliding_window": 8}, "with full attention"),
    # mlx-lm's exaone4 places windows by sliding_window_pattern (EXAONE-4.0-32B's "LLLG" passes, tests/real)
    ("exaone4", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                 "sliding_window_pattern": "LLLG"}, "places sliding layers by sliding_window_pattern ('LLLG')"),
]


@pytest.mark.parametrize(("arch", "overrides", "reason"), CASES, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in CASES])
def test_a_key_mlx_lm_would_drop_is_refused(cli, tmp_path, arch, overrides, reason):
    base = make_base(arch, tmp_path / "base", dims=overrides)
    out = tmp_path / "mlx"
    code, _, err = cli("export", "--base", base, "--target", "mlx", "--out", out)
    assert code == 2 and reason in err and "Traceback" not in err and not out.exists(), err


def test_a_key_transformers_does_not_read_is_inert(cli, zoo, tmp_path):
    """Metadata nothing reads (a made-up key here; real ones in tests/test_real_configs.py) passes, noted."""
    from tests_helpers import base_with_config

    base = base_with_config(zoo.base("llama"), tmp_path / "base", attn_temperature=0.5)
    code, stdout, err = cli("export", "--base", base, "--target", "mlx", "--out", tmp_path / "mlx", "--json")
    assert code == 0, err
    assert "config keys transformers' llama model does not read (inert): attn_temperature" in json.loads(stdout)[
        "notes"]


def test_every_architecture_has_rules_from_mlx_lm():
    """The rules come from mlx-lm's ModelArgs: every field is carried."""
    import dataclasses

    from tuneport.convert.mlx.config_keys import mlx_config_rules

    for arch, march in MLX_ARCHS.items():
        rules = mlx_config_rules(arch)
        fields = {f.name for f in dataclasses.fields(march.args())}
        assert all(rules[k].how == "carried" for k in fields), arch


def test_accept_config_key_exports_and_records_the_risk(cli, tmp_path):
    base = make_base("llama", tmp_path / "base", dims={"hidden_act": "gelu"})
    out = tmp_path / "mlx"
    code, stdout, err = cli("export", "--base", base, "--target", "mlx", "--out", out, "--json",
                            "--accept-config-key", "hidden_act")
    assert code == 0, err
    notes = json.loads((out / "manifest.json").read_text())["options"]["notes"]
    assert any(n.startswith("accepted risk (--accept-config-key): hidden_act = 'gelu'") for n in notes), notes
    assert json.loads((out / "manifest.json").read_text())["options"]["accept_config_keys"] == ["hidden_act"]


def test_a_key_the_config_leaves_out_is_written_at_transformers_default(cli, zoo, tmp_path):
    """A Qwen3-MoE config without norm_topk_prob runs with False in transformers; mlx-lm, left to itself, would
    assume its own default: the export writes transformers' value, and the model equals transformers."""
    import shutil

    import torch

    from tuneport.toolkit.fidelity import load_hf
    from tuneport.toolkit.verify.mlx_runner import load_mlx, mlx_logits

    base = tmp_path / "base"
    shutil.copytree(zoo.base("qwen3_moe"), base)
    cfg = json.loads((base / "config.json").read_text())
    del cfg["norm_topk_prob"]
    (base / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "mlx"
    code, stdout, err = cli("export", "--base", base, "--target", "mlx", "--out", out, "--json")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["norm_topk_prob"] is False
    assert any("norm_topk_prob written at transformers' default" in n for n in json.loads(stdout)["notes"])
    ids = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411]
    with torch.no_grad():
        want = load_hf(base)(torch.tensor([ids])).logits[0].float()
    assert (mlx_logits(load_mlx(out)[0], ids) - want).abs().max().item() <= 1e-4
