"""A 4-bit HF directory (compressed-tensors pack-quantized or AutoAWQ GEMM, ours or another tool's) run in
transformers with tuneport's own dequantization, for machines where vLLM cannot run it (no vLLM, or a CPU
without the AVX-512 its W4A16 kernel needs). The weights are exactly what the 4-bit checkpoint decodes to
(equal to compressed-tensors' own decompression); the compute is fp32, so logits are exact."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from tuneport.convert.arch import known_arch
from tuneport.convert.awq.formats import FORMATS, scheme_of
from tuneport.convert.cpu_features import w4a16_cpu_problem
from tuneport.convert.errors import UserError
from tuneport.convert.fused_experts import fuse_to_memory
from tuneport.convert.stored.int4 import quant_info

from .vllm_runner import VllmRunner, _bundle_model, adapter_for_awq_base


def is_4bit_dir(path: Path) -> bool:
    try:
        cfg = json.loads((_bundle_model(path) / "config.json").read_text())
    except (UserError, OSError, ValueError):
        return False
    return quant_info(cfg.get("quantization_config") or {}) is not None


def vllm_cannot_run_4bit(path: Path | None = None) -> bool:
    """No vLLM, or a CPU whose W4A16 kernels cannot run the 4-bit model at ``path``, and no GPU."""
    config = None
    if path is not None:
        try:
            config = json.loads((_bundle_model(path) / "config.json").read_text())
        except (UserError, OSError, ValueError):
            config = None
    return importlib.util.find_spec("vllm") is None or (w4a16_cpu_problem(config) is not None
                                                         and not torch.cuda.is_available())


def dequantized_state(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config without quantization_config, fp32 state dict with every 4-bit linear dequantized)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    fmt_name, scheme = scheme_of(cfg.pop("quantization_config"))
    fmt = FORMATS[fmt_name]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[k] = st.get_tensor(k)
    from tuneport.convert.awq.quant import dequantize

    marker = f".{fmt.marker}"
    state: dict[str, torch.Tensor] = {}
    modules = [k.removesuffix(marker) for k in tensors if k.endswith(marker)]
    for module in modules:
        state[f"{module}.weight"] = dequantize(fmt.unpack(tensors, module, scheme))
    packed = {n for m in modules for n in fmt.shapes(1, scheme.group_size, scheme, m) if n in tensors}
    packed |= {f"{m}.weight_zero_point" for m in modules}  # by name: shapes() lists it only when asymmetric
    for k, t in tensors.items():
        if k not in packed:
            state[k] = t.float() if t.is_floating_point() else t
    return cfg, state


def memory_names(model_type: str | None, model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a checkpoint's names) under ``model``'s module names: a multimodal checkpoint stores its
    towers under other prefixes (convert.multimodal); names that match neither stay as they are."""
    from tuneport.convert.multimodal import disk_names

    memory = list(model.state_dict())
    on_disk = list(disk_names(model_type, dict.fromkeys(memory, ()), set(state)))
    renamed = {m: state[d] for m, d in zip(memory, on_disk, strict=True) if d in state}
    used = {d for d in on_disk if d in state}
    return {**renamed, **{k: t for k, t in state.items() if k not in used}}


class DequantizedRunner(VllmRunner):
    engine = "transformers (4-bit weights dequantized by tuneport)"
    exact_logits = True

    def __init__(self, model: Path, lora: Path | None, n_ctx: int) -> None:  # noqa: D107 (no vLLM here)
        from transformers import AutoConfig, AutoModelForCausalLM

        self._open(model, lora)
        cfg, state = dequantized_state(self.model_dir)
        state = fuse_to_memory(known_arch(cfg.get("model_type")), state)  # experts as transformers 5 holds them
        config = AutoConfig.for_model(**cfg)
        model_ = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model_.load_state_dict(memory_names(cfg.get("model_type"), model_, state), strict=False)
        if unexpected or [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]:
            raise UserError(f"{self.model_dir} does not match its config ({(unexpected or missing)[:3]})",
                            "re-export the 4-bit model")
        if config.tie_word_embeddings:
            model_.tie_weights()
        model_.eval()
        if self.lora is not None:
            from peft import PeftModel

            with tempfile.TemporaryDirectory(prefix="tuneport-awq-lora-") as tmp:
                model_ = PeftModel.from_pretrained(model_, str(adapter_for_awq_base(self.lora, self.model_dir,
                                                                                    Path(tmp)))).eval()
        self.model = model_

    def prepare(self, ids: list[int], greedy_prompt: list[int], greedy_tokens: int) -> None:
        """Nothing to run ahead: logits come per call (the vLLM runner's one batched run is not needed)."""

    def _context(self, with_lora: bool):
        import contextlib

        return self.model.disable_adapter() if (self.lora is not None and not with_lora) else contextlib.nullcontext()

    @torch.no_grad()
    def logits(self, ids: list[int], with_lora: bool = True) -> torch.Tensor:
        with self._context(with_lora):
            return self.model(torch.tensor([ids])).logits[0].float()

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    def close(self) -> None:
        self.model = None
