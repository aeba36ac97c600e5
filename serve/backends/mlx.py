"""The MLX backend: tokens generated in this process by :class:`MlxEngine` (mlx-lm's model, our multi-adapter
layers and batching), answers built by :class:`~tuneport.serve.backends.inprocess.InProcessBackend`.

``--base`` may be an MLX LM directory (served as it is) or an HF directory / hub id (converted once with
``export --target mlx`` and cached by content; ``--dtype`` is the dtype of that conversion). Adapters may be
mlx-lm adapter directories (``adapters.safetensors`` + ``adapter_config.json``) or PEFT directories
(converted on load to mlx-lm's layout, cached by content and base).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from tuneport.convert.adapter import load_adapter
from tuneport.convert.cache import cache_dir, write_once
from tuneport.convert.checkpoint import Checkpoint, resolve_model_path
from tuneport.convert.errors import UserError
from tuneport.convert.export import cached_export
from tuneport.convert.hashing import config_digest, content_digest
from tuneport.convert.inputs import adapter_for
from tuneport.convert.merge import WeightedAdapter, plan_merge
from tuneport.convert.mlx import ADAPTER_WEIGHTS, DEFAULT_SCALE
from tuneport.convert.mlx.read import is_mlx_adapter, mlx_adapter_modules, mlx_model_info, read_mlx_adapter
from tuneport.convert.options import model_name
from tuneport.convert.targets import check_base

from ..engines.base import Event, GenerationRequest
from ..engines.hf_text import HfText
from ..engines.mlx import MlxEngine
from ..pool import PoolError
from .inprocess import InProcessBackend

log = logging.getLogger("tuneport.serve.mlx")


class MlxBackend(InProcessBackend):
    engine = "mlx"

    def __init__(self, base: str | Path, *, max_adapters: int = 8, adapter_dir: Path | None = None,
                 n_ctx: int = 2048, dtype: str = "auto") -> None:
        name = model_name(base)
        path = resolve_model_path(base)
        self.hf_base: Path | None = None
        if mlx_model_info(path) is not None:
            _check_dtype("mlx", dtype)
            model_dir = path
        elif path.is_dir():
            self.hf_base = path
            model_dir = cached_mlx(path, dtype)
        else:
            raise UserError(f"--base {path} is not a model directory", "pass an MLX LM or HF model directory")
        self.model_dir = model_dir
        self.mlx = MlxEngine(model_dir, n_ctx=n_ctx)
        try:
            super().__init__(name, max_adapters, adapter_dir)
            self.text = HfText(getattr(self.mlx.tokenizer, "_tokenizer", self.mlx.tokenizer))
        except BaseException:
            self.mlx.close()
            raise

    @classmethod
    def check_options(cls, opts, fmt: str) -> None:
        _check_dtype(fmt, opts.dtype)

    @classmethod
    def from_options(cls, opts) -> MlxBackend:
        return cls.start(opts, n_ctx=opts.n_ctx, dtype=opts.dtype)

    # -- adapters ------------------------------------------------------------------------------------
    def attach_adapter(self, name: str, path: Path) -> int:
        if is_mlx_adapter(path):
            source = path
        elif path.is_dir() and (path / "adapter_config.json").exists():
            source = self._convert_peft(path)
        else:
            raise PoolError(f"{path} is neither an mlx-lm adapter ({ADAPTER_WEIGHTS}) nor a PEFT directory",
                            "pass an mlx-lm adapter directory or a PEFT adapter directory", status=422)
        try:
            return self.mlx.load_adapter(name, read_mlx_lora(source))
        except UserError as e:
            raise PoolError(e.message, e.hint, status=422) from e

    def detach_adapter(self, name: str) -> None:
        self.mlx.unload_adapter(name)

    def _convert_peft(self, adapter_dir: Path) -> Path:
        """A PEFT adapter as an mlx-lm adapter directory for this base, converted once and cached."""
        from tuneport.convert.mlx.adapters import mlx_adapter, write_mlx_adapter

        base_dir = self.hf_base or self.model_dir
        out = cache_dir() / "mlx-adapters" / f"{content_digest(adapter_dir)}-{config_digest(base_dir)}"
        if out.exists():
            return out
        try:
            full = Checkpoint(base_dir)  # its own reader: conversions run in parallel threads
            ck = check_base(full, "mlx") if self.hf_base else full  # a multimodal model's text view
            adapter = adapter_for(load_adapter(adapter_dir), full, ck, "mlx")
            on_experts = adapter.param_loras or any(".experts." in m.module for m in adapter.modules.values())
            if self.hf_base is None and on_experts and any(".switch_mlp." in n for n in ck.names()):
                raise UserError(f"{adapter_dir.name} is a PEFT adapter and {base_dir.name} an MLX mixture-of-experts "
                                "model (experts stacked), which PEFT's names cannot be matched against",
                                "start with --base HF_DIR (the model the adapter was trained on), or pass the "
                                "mlx-lm adapter tuneport export --target mlx --adapters separate wrote")
            plan_merge(ck, [WeightedAdapter(adapter)])  # fits the base (MLX weights are read unpacked)
            converted = mlx_adapter(adapter, ck)
        except UserError as e:
            raise PoolError(e.message, e.hint, status=422) from e
        for note in converted.notes:
            log.info("%s", note)
        return write_once(out, lambda tmp: write_mlx_adapter(converted, tmp))

    # -- requests ------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.text.encode(text, special=add_bos is not False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, bool]:
        return self.text.chat(messages), False  # tools are refused for MLX before this (serve.openai_fields)

    @property
    def vocab_size(self) -> int:
        return self.mlx.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.mlx.n_ctx

    def token_bytes_bound(self) -> int:
        return self.text.token_bytes_bound()

    def piece(self, token: int) -> bytes:
        return self.text.piece(token)

    def run(self, request: GenerationRequest) -> Iterator[Event]:
        return self.mlx.events(request)

    # -- state ---------------------------------------------------------------------------------------
    def health(self) -> bool:
        return self.mlx.alive()

    def describe(self) -> dict:
        return {**super().describe(), "mlx_model": str(self.model_dir), "n_ctx": self.mlx.n_ctx,
                "max_batch": self.mlx.max_batch, "base_bytes": self.mlx.base_bytes,
                "adapter_bytes": self.mlx.stack_bytes, "mlx_active_bytes": self.mlx.active_bytes()}

    def close(self) -> None:
        self.mlx.close()


def read_mlx_lora(path: Path) -> dict:
    """An mlx-lm adapter directory as {module path: ModuleLora} with its scale folded into ``b``."""
    from ..engines.mlx_lora import ModuleLora

    cfg = read_mlx_adapter(path)
    kind = cfg.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise UserError(f"{path} is an mlx-lm {kind!r} fine-tune (whole weights), not LoRA",
                        "fuse it into the base (mlx_lm.fuse) and serve the result as --base")
    try:
        scale = float((cfg.get("lora_parameters") or {}).get("scale", DEFAULT_SCALE))
    except (TypeError, ValueError):
        raise UserError(f"{path / 'adapter_config.json'}: lora_parameters.scale is not a number", "") from None
    return {module: ModuleLora(p["lora_a"], p["lora_b"] * scale, p.get("m"), dora=kind == "dora")
            for module, p in mlx_adapter_modules(path).items()}


def cached_mlx(hf_dir: Path, dtype: str) -> Path:
    """The HF base as an MLX LM directory, converted once and cached by content."""
    return cached_export(hf_dir, "mlx", dtype=dtype)


def _check_dtype(fmt: str, dtype: str) -> None:
    if fmt == "mlx" and dtype != "auto":
        raise UserError(f"--dtype {dtype} applies to an HF base (the MLX model it is converted to)",
                        "drop --dtype: an MLX directory is served with its own types")
