"""What transformers' model reads from its config, derived from the installed transformers
(``convert/config_reads.py``), and the audit that judges a key by it: inert keys pass with a note, a key at the
value transformers derives anyway passes, a key that changes what the model computes is refused unless the user
accepts it (recorded as an accepted risk)."""

from __future__ import annotations

import json

import pytest
import transformers
from tests_helpers import base_with_config

from tuneport.convert.config_audit import INERT_KEYS
from tuneport.convert.config_reads import derive_read_set, judge_config, read_set
from tuneport.convert.gguf.config_keys import GGUF_CONFIG_RULES

# Names transformers 5's shared code (masking, caches, multimodal helpers) probes with getattr on every model's
# config: read when a config sets them, so the audit refuses them at a value that changes what it reads (no GGUF
# rule carries them). A name transformers starts reading that is neither here nor in a table fails
# test_every_key_transformers_reads_is_in_the_gguf_table: write its rule (or add it here, with the reason).
SHARED_PROBES = {"attention_chunk_size", "decoder", "generator", "is_causal", "is_heterogeneous", "layer_types",
                 "num_kv_shared_layers", "per_layer_config", "quantization_config", "sliding_window", "text_config",
                 "vision_aspect_ratio", "vision_feature_layer", "vision_feature_select_strategy"}


@pytest.mark.parametrize("arch", list(GGUF_CONFIG_RULES))
def test_every_key_transformers_reads_is_in_the_gguf_table(arch):
    """Fails when a transformers version starts reading a key the GGUF table does not handle."""
    reads = read_set(arch)
    assert reads is not None and reads.transformers_version == transformers.__version__
    handled = set(GGUF_CONFIG_RULES[arch]) | set(INERT_KEYS) | SHARED_PROBES
    unhandled = sorted(a for a in reads.attributes | (reads.config_reads & reads.class_keys)
                       if a not in handled and not a.startswith("_"))
    assert unhandled == [], f"transformers {transformers.__version__}'s {arch} reads {unhandled}: no GGUF rule"


# (architecture, keys that must be read, keys that must not): facts of transformers' modeling code
KNOWN = [
    ("llama", {"attention_bias", "mlp_bias", "rope_parameters", "tie_word_embeddings", "hidden_act", "head_dim",
               "rms_norm_eps"}, {"pretraining_tp", "unsloth_version", "sliding_window"}),
    ("qwen2", {"sliding_window", "layer_types", "head_dim"}, {"attention_bias", "max_window_layers"}),
    ("gemma2", {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "hidden_activation"}, {"hidden_act"}),
    ("qwen3_moe", {"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size"}, set()),
    ("qwen2_moe", {"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
                   "shared_expert_intermediate_size", "qkv_bias"}, {"attention_bias"}),
    ("granite", {"embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"}, set()),
]


@pytest.mark.parametrize(("arch", "read", "unread"), KNOWN, ids=[k[0] for k in KNOWN])
def test_the_derivation_finds_what_the_modeling_code_reads(arch, read, unread):
    reads = read_set(arch)
    assert read <= reads.own_keys(), read - reads.own_keys()
    assert not unread & reads.own_keys(), unread & reads.own_keys()


def test_the_trace_sees_the_shared_code_and_the_scan_sees_untaken_branches():
    """tie_word_embeddings is read by transformers' shared code only (the trace), Qwen2's sliding_window only on
    a branch the tiny model does not take (the scan); the fallback of a key a config may leave out is kept."""
    reads = derive_read_set("qwen2")
    assert "tie_word_embeddings" in reads.traced and "tie_word_embeddings" not in reads.scanned
    assert "sliding_window" in reads.scanned
    assert reads.fallbacks["head_dim"] == ("config.hidden_size // config.num_attention_heads",)
    assert {"use_sliding_window", "max_window_layers"} <= reads.config_reads  # Qwen2Config derives layer_types


def test_the_read_set_is_cached_per_transformers_version(monkeypatch):
    from tuneport.convert import config_reads
    from tuneport.convert.cache import cache_dir

    read_set.cache_clear()
    read_set("olmo2")
    cached = list((cache_dir() / "config-reads").glob(f"{transformers.__version__}-d*/olmo2.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["transformers_version"] == transformers.__version__
    monkeypatch.setattr(config_reads, "transformers_version", lambda: "99.0.0")
    read_set.cache_clear()
    assert read_set("olmo2").transformers_version == "99.0.0"  # derived again, not the other version's file
    assert list((cache_dir() / "config-reads").glob("99.0.0-d*/olmo2.json"))
    read_set.cache_clear()


QWEN2 = {  # Qwen2.5-0.5B-Instruct's config.json (sizes as published), plus what tools add
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "max_window_layers": 21, "rope_theta": 1000000.0, "sliding_window": 32768,
    "use_sliding_window": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "use_cache": True, "bos_token_id": 151643, "eos_token_id": 151645,
    "attention_dropout": 0.0, "initializer_range": 0.02, "transformers_version": "4.43.1", "rope_scaling": None,
}


@pytest.mark.parametrize(("extra", "key", "kind"), [
    ({"unsloth_version": "2026.4.2"}, "unsloth_version", "inert"),
    ({"unsloth_fixed": True}, "unsloth_fixed", "inert"),
    ({"_model_name_or_path": "Qwen2.5-0.5B-Instruct-Q8_0.gguf"}, "_model_name_or_path", "inert"),
    ({"head_dim": 64}, "head_dim", "redundant"),  # = 896 / 14
    ({"head_dim": 128}, "head_dim", "read"),
    ({"rope_scaling": {"rope_type": "default"}}, "rope_scaling", "redundant"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling", "read"),
    ({"hidden_act": "gelu"}, "hidden_act", "read"),
    ({"use_sliding_window": True}, "use_sliding_window", "read"),  # decides layer_types through Qwen2Config
    ({}, "max_window_layers", "redundant"),  # no sliding window: the layer count it sets changes nothing
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]}" for k in v) or "none")
def test_a_key_is_judged_by_what_it_changes(extra, key, kind):
    verdict = judge_config({**QWEN2, **extra}).verdicts[key]
    assert verdict.kind == kind, verdict
    if kind == "read":
        assert verdict.differs and verdict.describe_difference()


@pytest.mark.parametrize("target", ["gguf", "mlx"])
def test_attention_implementation_and_tool_metadata_export(cli, zoo, tmp_path, target):
    """What fine-tuning tools and transformers' GGUF loader write (unsloth_version, _model_name_or_path,
    attn_implementation, a redundant head_dim) does not stop an export: the inert keys are named in the manifest's
    notes, and so is a redundant head_dim where no rule of the target carries it (mlx-lm's qwen2 has none)."""
    cfg = json.loads((zoo.base("qwen2") / "config.json").read_text())
    base = base_with_config(zoo.base("qwen2"), tmp_path / "base", unsloth_version="2026.4.2", unsloth_fixed=True,
                            _model_name_or_path="model-Q8_0.gguf", attn_implementation="flash_attention_2",
                            head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
    pytest.importorskip("gguf" if target == "gguf" else "mlx_lm")
    code, stdout, err = cli("export", "--base", base, "--target", target, "--out", tmp_path / target, "--json",
                            *(["--quant", "f32"] if target == "gguf" else []))
    assert code == 0, err
    notes = json.loads(stdout)["notes"]
    assert "config keys transformers' qwen2 model does not read (inert): unsloth_version, unsloth_fixed, " \
           "_model_name_or_path" in notes, notes
    if target == "mlx":
        assert "config keys at the value transformers derives without them: head_dim" in notes, notes


def test_a_read_key_without_a_rule_is_refused_then_accepted(cli, zoo, tmp_path):
    base = base_with_config(zoo.base("llama"), tmp_path / "base", attention_chunk_size=2)
    out = tmp_path / "gguf"
    code, _, err = cli("export", "--base", base, "--target", "gguf", "--quant", "f32", "--out", out)
    assert code == 2 and not out.exists(), err
    assert "config key 'attention_chunk_size' = 2 changes what transformers' llama model computes " \
           "(attention_chunk_size 2 (without the key: none))" in err, err
    assert "--accept-config-key attention_chunk_size" in err and "Traceback" not in err
    code, stdout, err = cli("export", "--base", base, "--target", "gguf", "--quant", "f32", "--out", out,
                            "--accept-config-key", "attention_chunk_size", "--json")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["accept_config_keys"] == ["attention_chunk_size"]
    assert any(n.startswith("accepted risk (--accept-config-key): attention_chunk_size = 2") for n in
               manifest["options"]["notes"]), manifest["options"]["notes"]


def test_accept_config_key_is_refused_by_targets_without_an_audit(cli, zoo, tmp_path):
    code, _, err = cli("export", "--base", zoo.base("llama"), "--target", "vllm", "--out", tmp_path / "v",
                       "--accept-config-key", "x")
    assert code == 2 and "--accept-config-key does not apply to --target vllm" in err, err
