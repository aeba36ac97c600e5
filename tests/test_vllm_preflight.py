"""vLLM's CPU preflight as data: head sizes its attention has kernels for, one sequence's KV cache against
VLLM_CPU_KVCACHE_SPACE (vLLM's own dtype rule, parallelism, flags passed through)."""

from __future__ import annotations

import pytest

from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.errors import UserError
from tuneport.serve.options import ServeOptions
from tuneport.serve.vllm_preflight import check_cpu_kv_space, check_vllm_cpu


def test_kv_space_is_checked_as_vllm_counts_it(zoo, monkeypatch):
    ckpt = Checkpoint(zoo.base("llama"))  # fp32; 2 layers × 2 KV heads × head size 32
    per_token_bf16 = 2 * 2 * 2 * 32 * 2  # vLLM runs an fp32 checkpoint in bf16 unless told otherwise
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(per_token_bf16 * 1000 / 2**30))  # 1,000 tokens fit
    opts = dict(base=str(zoo.base("llama")), engine="vllm")
    check_cpu_kv_space(ckpt, ServeOptions(**opts, max_model_len=1000))
    with pytest.raises(UserError, match=r"one sequence of 1001 tokens needs .* \(at most 1000 fits\)"):
        check_cpu_kv_space(ckpt, ServeOptions(**opts, max_model_len=1001))
    with pytest.raises(UserError, match="at most 500 fits"):  # fp32 KV: twice the bytes
        check_cpu_kv_space(ckpt, ServeOptions(**opts, max_model_len=1001, dtype="fp32"))
    check_cpu_kv_space(ckpt, ServeOptions(**opts, max_model_len=2000, tensor_parallel_size=2))  # half each
    check_cpu_kv_space(ckpt, ServeOptions(**opts, vllm_args=["--max-model-len", "99999"]))  # vLLM's to judge
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM sizes it from free memory: nothing to check
    check_vllm_cpu(ckpt, ServeOptions(**opts, max_model_len=10**6))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_is_refused_before_vllm_cpu_starts(zoo, cli, arch):
    """tuneport serve enables LoRA, with which vllm-cpu 0.32 fails to start on a MoE model (Triton kernels
    only): refused at once with the engine that serves it, before vLLM loads anything."""
    with pytest.raises(UserError, match="GPU \\(Triton\\) kernels only") as e:
        check_vllm_cpu(Checkpoint(zoo.base(arch)), ServeOptions(base=str(zoo.base(arch)), engine="vllm"))
    assert "--engine llamacpp" in e.value.hint
    from tuneport.serve.vllm_bugs import vllm_platform

    if vllm_platform() != "cpu":
        return  # a GPU build serves it
    code, _, err = cli("serve", "--base", zoo.base(arch), "--engine", "vllm", "--port", "0")
    assert code == 2 and "mixture-of-experts" in err and "Traceback" not in err, err


def test_vllm_is_given_what_it_reads_to_compute_as_transformers():
    """Ministral 3's attention temperature: transformers reads rope_parameters.llama_4_scaling_beta, vLLM 0.32's
    Mistral model only config.llama_4_scaling, so the bundle's config.json carries both and tuneport serve passes
    the key to vLLM as --hf-overrides (tests/test_vllm_export.py proves the bundle's tokens in vLLM)."""
    import json

    from tuneport.convert.vllm_rules import vllm_config_updates
    from tuneport.serve.engines.vllm import VllmLaunch

    config = {"model_type": "ministral3", "max_position_embeddings": 262144, "rope_parameters": {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384, "llama_4_scaling_beta": 0.1}}
    updates = vllm_config_updates(config)
    assert updates == {"llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 16384}}
    assert vllm_config_updates({**config, **updates}) == {} and vllm_config_updates({"model_type": "mistral"}) == {}
    args = VllmLaunch("m", "m", 16, 1, 1, hf_overrides=updates).args()
    assert json.loads(args[args.index("--hf-overrides") + 1]) == updates
    assert "--hf-overrides" not in VllmLaunch("m", "m", 16, 1, 1).args()


def assert_vllm_refuses_patched(base_dir, patch: dict, why: str, tmp_path, cli) -> None:
    """``base_dir`` (linked) with ``patch`` in its config.json is refused for --target vllm: exit 2, ``why`` and the
    targets that read it named, nothing written."""
    import json

    base = tmp_path / "base"
    base.mkdir()
    for f in base_dir.iterdir():
        (base / f.name).symlink_to(f)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").unlink()
    (base / "config.json").write_text(json.dumps({**cfg, **patch}))
    out = tmp_path / "out"
    code, _, err = cli("export", "--base", base, "--target", "vllm", "--adapters", "merge", "--out", out)
    assert code == 2 and why in err and "--target gguf / mlx" in err and not out.exists(), err


@pytest.mark.parametrize(("patch", "why"), [
    ({"rms_norm_eps": 1e-6}, "RMSNorm eps 1e-5 whatever config.json says"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding window on the even layers"),
    ({"swiglu_limit": 5.0}, "hard-codes SwiGLU alpha 1.702 and limit 7.0"),
])
def test_what_vllm_hard_codes_for_gpt_oss_is_refused(zoo, tmp_path, cli, patch, why):
    """vLLM's GptOssForCausalLM reads neither rms_norm_eps, layer_types nor the SwiGLU clamp from config.json: a
    model that sets them otherwise than vLLM's constants is refused for --target vllm (exit 2, nothing written)."""
    assert_vllm_refuses_patched(zoo.base("gpt_oss"), patch, why, tmp_path, cli)


@pytest.mark.parametrize(("patch", "why"), [
    ({"time_step_limit": [0.0, 10.0]}, "never clamps the Mamba step size"),
    ({"mamba_n_groups": 2}, "normalizes the Mamba output per group"),
])
def test_what_vllm_hard_codes_for_granite_4_is_refused(zoo, tmp_path, cli, patch, why):
    """vLLM's GraniteMoeHybridForCausalLM never clamps the step size and normalizes per group: a Granite 4 that clamps
    (time_step_limit) or has several groups is refused for --target vllm (exit 2, nothing written); the released
    configs (no clamp, one group) export (tests/test_vllm_export.py serves them)."""
    assert_vllm_refuses_patched(zoo.base("granitemoehybrid"), patch, why, tmp_path, cli)


def test_llama4_temperature_reaches_vllm_through_generation_config(zoo, tmp_path, cli):
    """vLLM 0.32's Llama 4 reads attn_temperature_tuning from generation_config.json only (on by default only past a
    32768-token max_model_len); transformers from config.json. The bundle's generation_config.json carries it, read
    as vLLM reads it (GenerationConfig's non-default values), and tuneport serve passes --override-generation-config."""
    import json

    from transformers import GenerationConfig

    from tuneport.convert.vllm_rules import vllm_generation_updates
    from tuneport.serve.engines.vllm import VllmLaunch

    base = zoo.base("llama4_text")
    code, _, err = cli("export", "--base", base, "--target", "vllm", "--adapters", "merge", "--out", tmp_path / "b")
    assert code == 0, err
    assert GenerationConfig.from_pretrained(tmp_path / "b").to_diff_dict()["attn_temperature_tuning"] is True
    updates = vllm_generation_updates(json.loads((base / "config.json").read_text()))
    assert updates == {"attn_temperature_tuning": True} and vllm_generation_updates({"model_type": "llama"}) == {}
    args = VllmLaunch("m", "m", 16, 1, 1, generation_overrides=updates).args()
    assert json.loads(args[args.index("--override-generation-config") + 1]) == updates
