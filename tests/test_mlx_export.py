"""``export --target mlx`` in real mlx-lm (mlx[cpu]): every architecture of the table equals transformers
in fp32, quantized exports hold exactly the tensors ``mlx_lm.convert`` writes, and every LoRA variant
exported as an mlx-lm adapter equals PEFT unmerged (or is refused with its reason)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_merge_equivalence import moe_cases

from tuneport.convert.arch import known_arch
from tuneport.convert.mlx.archs import MLX_ARCHS
from tuneport.convert.multimodal import TEXT_TOWERS
from tuneport.convert.support_matrix import supported
from tuneport.toolkit.fidelity import compare_logits, load_hf, load_peft
from tuneport.toolkit.tiny import VARIANTS
from tuneport.toolkit.tiny.adapters import make_adapter
from tuneport.toolkit.tiny.models import make_base
from tuneport.toolkit.verify.mlx_runner import load_mlx, mlx_logits

TOL = 1e-4
DELTA_NET_MOE_TOL = 2e-4  # Qwen3.5-MoE: expert LoRA over recurrent layers, fp32 accumulation 1.2e-4 apart (measured)
# 24 tokens: past the 4-token sliding window of the Gemma 3 base below
IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
# Which fixtures adapt modules each architecture has (phi3 fuses q/k/v and gate/up)
ARCH_VARIANTS = {
    "llama": list(VARIANTS),
    "mistral": ["plain", "rslora", "patterns"],
    "qwen2": ["plain", "all_linear", "patterns", "dora", "embedding", "layers"],
    "qwen3": ["all_linear", "dora"],
    "gemma3_text": ["all_linear", "dora", "embedding", "layers"],
    "phi3": ["all_linear"],
    "olmo2": ["all_linear", "dora", "layers"],
    "granite": ["all_linear", "embedding", "rslora"],
    # Qwen3.5: mlx-lm's tree wraps the text model (language_model.*); LoRA on the linear layers' projections too
    "qwen3_5_text": ["all_linear", "dora", "embedding", "layers"],
    "smollm3": ["all_linear", "patterns", "layers"],
    "mixtral": ["plain", "all_linear", "rslora", "layers"],
    "qwen3_moe": ["plain", "all_linear", "rslora", "patterns"],
}
# Gemma 3 with a global layer every 2 and a 4-token window, so both kinds of layer run (the zoo's
# two-layer Gemma has sliding layers only, which mlx-lm cannot express).
GEMMA_DIMS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}


@pytest.fixture(scope="module")
def bases(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-bases")
    made: dict[tuple[str, bool], Path] = {}

    def get(arch: str, tied: bool = False) -> Path:
        if (arch, tied) not in made:
            if arch in ("gemma3_text", "gemma3"):  # a global layer, as mlx-lm's Gemma 3 needs one
                made[arch, tied] = make_base(arch, root / f"{arch}-{tied}", tied=tied, dims=GEMMA_DIMS)
            else:
                made[arch, tied] = zoo.base(arch, tied=tied)
        return made[arch, tied]
    return get


@pytest.fixture(scope="module")
def adapters(zoo, bases, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-adapters")

    def get(arch: str, variant: str) -> Path:
        if arch != "gemma3_text":
            return zoo.adapter(arch, variant)
        out = root / variant
        if not (out / "adapter_config.json").exists():
            make_adapter(bases(arch, VARIANTS[variant].tied_base), variant, out)
        return out
    return get


def reference(base: Path, adapter: Path | None = None) -> torch.Tensor:
    model = load_peft(base, adapter) if adapter else load_hf(base)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


def in_mlx(model_dir: Path, adapter: Path | None = None) -> torch.Tensor:
    return mlx_logits(load_mlx(model_dir, adapter)[0], IDS)


def export(cli, base: Path, out: Path, *args) -> dict:
    code, stdout, err = cli("export", "--base", base, "--target", "mlx", "--out", out, "--json", *args)
    assert code == 0, err
    return json.loads(stdout)


@pytest.mark.parametrize(("arch", "tied"),
                         [(a, False) for a in supported("mlx")] + [("llama", True), ("gemma3_text", True)])
def test_every_architecture_equals_transformers(cli, bases, tmp_path, arch, tied):
    base = bases(arch, tied)
    export(cli, base, tmp_path / "mlx")
    diff = (in_mlx(tmp_path / "mlx") - reference(base)).abs().max().item()
    # Qwen3.5-MoE's recurrent layers and routing: 1.13e-4 measured with one torch thread (make test's workers)
    assert diff <= (DELTA_NET_MOE_TOL if arch.startswith("qwen3_5_moe") else TOL), f"{arch}: max |Δlogit| {diff:.2e}"


def test_rope_base_only_in_rope_parameters_is_written_where_mlx_reads_it(cli, bases, tmp_path):
    """A qwen2 saved by transformers 5 keeps rope_theta (10000, mlx-lm's default is 1e6) only inside
    rope_parameters: loaded as is, mlx-lm silently runs another rope; exported, it equals transformers."""
    base = bases("qwen2")
    cfg = json.loads((base / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 10000.0
    ref = reference(base)
    assert (in_mlx(base) - ref).abs().max().item() > 0.1  # the gap is real
    result = export(cli, base, tmp_path / "mlx")
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["rope_theta"] == 10000.0
    assert any("rope_theta" in n for n in result["notes"])
    assert (in_mlx(tmp_path / "mlx") - ref).abs().max().item() <= TOL


QUANTS = [("q4", None, "fp32"), ("q8", "32", "fp32"), ("q4", "128", "fp32"), ("mixed_3_6", "64", "fp32"),
          ("mxfp4", None, "fp32"), ("q3", "32", "fp32"), ("q4", "64", "bf16"), ("nvfp4", None, "bf16")]


def _tensors(directory: Path) -> dict:
    import mlx.core as mx

    out = {}
    for f in sorted(directory.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize(("quant", "group", "dtype"), QUANTS)
def test_quantized_export_is_what_mlx_lm_convert_writes(cli, zoo, adapters, tmp_path, capsys, quant, group, dtype):
    """The same merged fine-tune: tuneport's streaming export and mlx_lm.convert of the merged HF
    directory hold the same quantized tensors bit for bit; KL to the fp32 export is reported."""
    import mlx.core as mx
    from mlx_lm.convert import convert

    from tuneport.convert.mlx.quant import QUANT_TYPES

    base, adapter = zoo.base("llama", dtype), zoo.adapter("llama", "all_linear", dtype)
    code, _, err = cli("export", "--base", base, "--adapter", adapter, "--target", "safetensors",
                       "--out", tmp_path / "merged")
    assert code == 0, err
    q = QUANT_TYPES[quant]
    convert(str(tmp_path / "merged"), str(tmp_path / "by-mlx-lm"), quantize=True, q_bits=None if q.mixed else q.bits,
            q_group_size=int(group) if group else None, q_mode=q.mode,
            quant_predicate=quant if q.mixed else None)
    export(cli, base, tmp_path / "ours", "--adapter", adapter, "--quant", quant,
           *(["--group-size", group] if group else []))
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "by-mlx-lm")
    assert sorted(ours) == sorted(theirs)
    different = [k for k in ours if ours[k].dtype != theirs[k].dtype or not mx.array_equal(ours[k], theirs[k]).item()]
    assert not different, different[:5]
    cfg_ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    cfg_theirs = json.loads((tmp_path / "by-mlx-lm" / "config.json").read_text())
    assert cfg_ours["quantization"] == cfg_theirs["quantization"]

    export(cli, base, tmp_path / "fp32", "--adapter", adapter)
    cmp = compare_logits(in_mlx(tmp_path / "fp32"), in_mlx(tmp_path / "ours"))
    with capsys.disabled():
        print(f"\n  mlx {quant} group {group or 'default'}: KL to the unquantized {dtype} export "
              f"{cmp.kl:.2e}, top-1 {cmp.top1:.3f}, max |Δlogit| {cmp.max_abs:.3f} (tensors equal mlx_lm.convert's)")
    assert cmp.kl < {8: 1e-3, 6: 0.05, 5: 0.1, 4: 0.25}.get(q.bits, 0.6)  # random tiny weights quantize badly


def _cases() -> list[tuple[str, str]]:
    return [(a, v) for a, vs in ARCH_VARIANTS.items() for v in vs]


@pytest.mark.parametrize(("arch", "variant"), _cases())
def test_every_lora_variant_as_mlx_adapter_equals_peft(cli, bases, adapters, tmp_path, arch, variant):
    spec = VARIANTS[variant]
    base, adapter = bases(arch, spec.tied_base), adapters(arch, variant)
    out = tmp_path / "separate"
    if spec.mlx_refusal:
        code, _, err = cli("export", "--base", base, "--adapter", f"{variant}={adapter}", "--target", "mlx",
                           "--adapters", "separate", "--out", out)
        assert code == 2 and spec.mlx_refusal in err and "--adapters merge" in err, err
        assert not out.exists()
        return
    export(cli, base, out, "--adapter", f"{variant}={adapter}", "--adapters", "separate")
    config = json.loads((out / "adapters" / variant / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == ("dora" if "dora" in variant else "lora")
    ref = reference(base, adapter)
    separate = in_mlx(out, out / "adapters" / variant)
    diff = (separate - ref).abs().max().item()
    assert diff <= TOL, f"{arch}/{variant}: mlx-lm adapter vs PEFT max |Δlogit| {diff:.2e}"
    assert (separate - reference(base)).abs().max().item() > 10 * TOL  # the adapter does something

    export(cli, base, tmp_path / "merged", "--adapter", adapter)
    merged = in_mlx(tmp_path / "merged")
    assert (merged - separate).abs().max().item() <= TOL


# Llama 4 as released exports its text model (llama4_text) renamed: its parity and LoRA tests cover the renaming, the
# expert LoRA runs on llama4_text (CI time)
MOE = [a for a in supported("mlx") if (spec := known_arch(a)) is not None and spec.experts is not None
       and a != "llama4"]


@pytest.mark.parametrize("arch,variant", moe_cases(MOE, ("experts", "experts_patterns", "per_expert", "all_linear")))
def test_expert_lora_as_mlx_adapter_equals_peft(cli, zoo, tmp_path, arch, variant):
    """LoRA on the experts (fused target_parameters, transformers 4's per-expert modules, or all linears with the
    router) as mlx-lm's LoRASwitchLinear on the stacked switch_mlp: unmerged and merged = PEFT."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, variant)
    out = tmp_path / "separate"
    export(cli, base, out, "--adapter", f"{variant}={adapter}", "--adapters", "separate")
    ref = reference(base, adapter)
    separate = in_mlx(out, out / "adapters" / variant)
    tol = DELTA_NET_MOE_TOL if arch.startswith("qwen3_5_moe") else TOL
    assert (separate - ref).abs().max().item() <= tol
    assert (separate - reference(base)).abs().max().item() > 0.1
    export(cli, base, tmp_path / "merged", "--adapter", adapter)
    assert (in_mlx(tmp_path / "merged") - ref).abs().max().item() <= tol


@pytest.mark.parametrize(("quant", "group"), [("q4", "64"), ("mixed_3_6", "64"), ("mxfp4", None)])
@pytest.mark.parametrize("arch", MOE)
def test_quantized_experts_are_what_mlx_lm_convert_writes(cli, zoo, tmp_path, arch, quant, group):
    """Stacked experts quantized as mlx-lm's QuantizedSwitchLinear, the model's own quant_predicate honoured
    (Qwen3-MoE's router at 8 bits): the same tensors and quantization config as mlx_lm.convert of the
    unquantized export (mlx_lm.convert cannot read a transformers 5 Qwen3-MoE config.json itself)."""
    import mlx.core as mx
    from mlx_lm.convert import convert

    from tuneport.convert.mlx.quant import QUANT_TYPES

    base, adapter = zoo.base(arch), zoo.adapter(arch, "all_linear")
    export(cli, base, tmp_path / "fp32", "--adapter", adapter)
    q = QUANT_TYPES[quant]
    convert(str(tmp_path / "fp32"), str(tmp_path / "by-mlx-lm"), quantize=True, q_bits=None if q.mixed else q.bits,
            q_group_size=int(group) if group else None, q_mode=q.mode, quant_predicate=quant if q.mixed else None)
    export(cli, base, tmp_path / "ours", "--adapter", adapter, "--quant", quant,
           *(["--group-size", group] if group else []))
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "by-mlx-lm")
    text_type = TEXT_TOWERS[arch].text_model_type if arch in TEXT_TOWERS else arch
    if (prefix := MLX_ARCHS[text_type].weight_prefix) and not MLX_ARCHS[text_type].wrapper:
        # mlx_lm.convert saves the tree mlx-lm built (Qwen3.5's under language_model., its conv and norms as mlx-lm
        # computes with them); tuneport writes the HF layout mlx-lm sanitizes on load: the quantized tensors compared
        # (a wrapper's, Llama 4's, tuneport writes as mlx-lm's tree already: all compared)
        theirs = {k.removeprefix(prefix): v for k, v in theirs.items()}
        packed = {k.rsplit(".", 1)[0] for k in theirs if k.endswith(".scales")}
        ours = {k: v for k, v in ours.items() if k.rsplit(".", 1)[0] in packed}
        theirs = {k: v for k, v in theirs.items() if k.rsplit(".", 1)[0] in packed}
    assert sorted(ours) == sorted(theirs) and any(f".{MLX_ARCHS[text_type].switch_block}." in k for k in ours)
    different = [k for k in ours if ours[k].dtype != theirs[k].dtype or not mx.array_equal(ours[k], theirs[k]).item()]
    assert not different, different[:5]
    cfg_ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    cfg_theirs = json.loads((tmp_path / "by-mlx-lm" / "config.json").read_text())
    assert cfg_ours["quantization"] == cfg_theirs["quantization"]
    cmp = compare_logits(in_mlx(tmp_path / "fp32"), in_mlx(tmp_path / "ours"))
    # random tiny weights quantize badly (Qwen3.5's recurrent layers and its routing carry the rounding: KL 1.5-2.3
    # measured); the equality above is the check
    assert cmp.kl < (3.0 if arch.startswith("qwen3_5") else 0.6), cmp


def test_refused_variants_merge_exactly(cli, bases, adapters, tmp_path):
    """What an mlx-lm adapter cannot hold (modules_to_save, a resized vocabulary) merges exactly."""
    base, adapter = bases("llama"), adapters("llama", "modules_to_save")
    export(cli, base, tmp_path / "merged", "--adapter", adapter)
    diff = (in_mlx(tmp_path / "merged") - reference(base, adapter)).abs().max().item()
    assert diff <= TOL


@pytest.mark.parametrize(("args", "message"), [
    (["--quant", "q7"], "not an mlx-lm quantization"),
    (["--quant", "q4,q8"], "one model per export"),
    (["--quant", "q4", "--group-size", "48"], "--group-size 48"),
    (["--quant", "mxfp4", "--group-size", "64"], "groups of 32"),
    (["--group-size", "64"], "--group-size applies with --quant"),
    (["--bpe-pre", "llama3"], "--bpe-pre does not apply to --target mlx"),
    (["--adapters", "separate"], "needs at least one --adapter"),
])
def test_bad_options_exit_2_and_write_nothing(cli, bases, tmp_path, args, message):
    out = tmp_path / "out"
    code, _, err = cli("export", "--base", bases("llama"), "--target", "mlx", "--out", out, *args)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_python_api_takes_the_cli_options(bases, adapters, tmp_path):
    import tuneport

    result = tuneport.export(base=bases("llama"), target="mlx", out=tmp_path / "mlx", quant="q8", group_size=32,
                             adapters=[f"a={adapters('llama', 'plain')}"], adapter_mode="separate")
    assert result.details["quant"] == "q8" and result.details["adapters"] == {"a": "adapters/a"}
    manifest = json.loads((tmp_path / "mlx" / "manifest.json").read_text())
    assert manifest["target"] == "mlx" and manifest["options"]["group_size"] == 32
    assert {o["path"] for o in manifest["outputs"]} >= {"model.safetensors", "config.json",
                                                        "adapters/a/adapters.safetensors"}
    assert np.isfinite(in_mlx(tmp_path / "mlx", tmp_path / "mlx" / "adapters" / "a").numpy()).all()


@pytest.mark.slow
def test_quantization_kl_on_a_trained_model(tmp_path, capsys):
    """KL(fp32 ‖ quantized) in mlx-lm on held-out text for every --quant type, on the trained llama."""
    import mlx.core as mx
    from transformers import AutoTokenizer

    import tuneport
    from tuneport.convert.calibration.text import HELDOUT_MODULES, stdlib_text, token_chunks
    from tuneport.convert.mlx.quant import QUANT_TYPES
    from tuneport.toolkit.tiny.trained import trained_llama

    base = trained_llama()
    # 4 x 128 held-out tokens (mlx-lm's forward of 8 took ~3 s on 2 CPU cores, 13 times; 16 chunks gave KLs within
    # 10% of 8, and the order the test asserts spans factors of 3 and more)
    chunks = token_chunks(AutoTokenizer.from_pretrained(base), stdlib_text(HELDOUT_MODULES), 128)[:4]

    def log_probs(directory: Path) -> torch.Tensor:
        model = load_mlx(directory)[0]
        return torch.log_softmax(torch.from_numpy(np.array(model(mx.array(chunks)).astype(mx.float32))).double(), -1)

    tuneport.export(base=base, target="mlx", out=tmp_path / "fp32")
    ref = log_probs(tmp_path / "fp32")
    rows = []
    for name in QUANT_TYPES:
        out = tmp_path / name
        tuneport.export(base=base, target="mlx", out=out, quant=name)
        kl = float((ref.exp() * (ref - log_probs(out))).sum(-1).mean())
        size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
        rows.append((name, kl, size))
    with capsys.disabled():
        print("\nKL(fp32 || quantized) in mlx-lm on held-out text, trained llama (4.6M parameters):")
        for name, kl, size in rows:
            print(f"  {name:10} KL {kl:.5f}  weights {size / 1e6:.2f} MB")
    kls = dict((n, k) for n, k, _ in rows)
    assert kls["q8"] < kls["q6"] < kls["q4"] < kls["q3"] < kls["q2"]
    assert kls["q8"] < 2e-3 and kls["q4"] < 0.1


def test_moe_with_a_dense_layer_as_mlx_adapter_equals_peft(cli, tmp_path):
    """Qwen3-MoE with a dense first layer (mlp_only_layers): the adapter's expert keys exist in the sparse layer
    only, and mlx-lm adapts each layer's own modules; unmerged = PEFT."""
    base = make_base("qwen3_moe", tmp_path / "base", dims={"mlp_only_layers": [0]})
    adapter = make_adapter(base, "all_linear", tmp_path / "adapter")
    out = tmp_path / "separate"
    export(cli, base, out, "--adapter", f"a={adapter}", "--adapters", "separate")
    separate = in_mlx(out, out / "adapters" / "a")
    assert (separate - reference(base, adapter)).abs().max().item() <= TOL
    assert (separate - reference(base)).abs().max().item() > 0.1
