"""What the gateway serves: an engine, its adapter pool, tokenization and chat rendering, and metrics.

``--base`` may be a GGUF file or an HF directory (converted once to F16 GGUF and cached); adapters may be
GGUF LoRA files or PEFT directories (converted on load for an HF base, cached by content hash).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

from convert.errors import UserError
from convert.io import cache_dir, content_digest, write_once

from .engines.base import GenerationRequest
from .engines.llamacpp import LlamaCppEngine
from .metrics import Metrics
from .pool import AdapterPool, PoolError, check_name


class LlamaCppService:
    def __init__(self, base: str | Path, max_adapters: int = 8, adapter_dir: Path | None = None,
                 n_ctx: int = 2048, n_workers: int = 2, kv_f32: bool = False, served_name: str | None = None) -> None:
        base = Path(base)
        self.hf_base: Path | None = None
        if base.is_dir():
            self.hf_base = base
            model_path = self._cached_gguf(base)
        elif base.suffix == ".gguf" and base.is_file():
            model_path = base
        else:
            raise UserError(f"--base {base} is neither a GGUF file nor a model directory", "pass one of them")
        self.name = served_name or (base.stem if base.is_file() else base.name)
        self.engine = LlamaCppEngine(model_path, n_ctx=n_ctx, n_workers=n_workers, kv_f32=kv_f32)
        self.pool = AdapterPool(self._load, self.engine.unload_adapter, max_adapters, adapter_dir)
        self.metrics = Metrics()
        self.chat_template = self.engine.metadata("tokenizer.chat_template")
        self.add_bos = (self.engine.metadata("tokenizer.ggml.add_bos_token") or "true") == "true"
        self.created = int(time.time())

    @staticmethod
    def _cached_gguf(hf_dir: Path) -> Path:
        """The HF base as F16 GGUF, converted once and cached by content (config, tokenizer, weight stats)."""
        from convert.checkpoint import Checkpoint
        from convert.gguf.export import export_gguf

        ck = Checkpoint(hf_dir)
        h = hashlib.sha256()
        for f in [hf_dir / "config.json", *ck.side_files()]:
            h.update(f.name.encode() + f.read_bytes())
        for f in ck.weight_files:
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        out = cache_dir() / "gguf" / h.hexdigest()[:24]
        if not out.exists():
            export_gguf(hf_dir, [], out, quant="f16", name="model")
        return out / "model-F16.gguf"

    def _load(self, name: str, path: Path) -> int:
        if path.is_dir() and (path / "adapter_config.json").exists():
            path = self._convert_peft(path)
        elif path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise PoolError(f"{path} holds no single GGUF LoRA", "pass a .gguf file or a PEFT directory",
                                status=422)
            path = ggufs[0]
        try:
            return self.engine.load_adapter(name, path)
        except UserError as e:
            raise PoolError(e.message, e.hint, status=422) from e

    def _convert_peft(self, adapter_dir: Path) -> Path:
        if self.hf_base is None:
            raise PoolError(f"{adapter_dir} is a PEFT adapter; converting it needs the HF base",
                            "start with --base HF_DIR, or export GGUF LoRAs with tuneport export --target gguf",
                            status=422)
        from convert.adapter import load_adapter
        from convert.arch import arch_for
        from convert.checkpoint import Checkpoint
        from convert.gguf.lora import build_gguf_lora, write_gguf_lora

        out = cache_dir() / "loras" / f"{content_digest(adapter_dir)}.gguf"
        if not out.exists():
            try:
                ck = Checkpoint(self.hf_base)
                arch = arch_for(ck.model_type)
                lora = build_gguf_lora(load_adapter(adapter_dir), ck, arch)
            except UserError as e:
                raise PoolError(e.message, e.hint, status=422) from e
            write_once(out, lambda tmp: write_gguf_lora(tmp, lora, arch, adapter_dir.name))
        return out

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.engine.tokenize(text, self.add_bos if add_bos is None else add_bos, special=True)

    @functools.cached_property
    def _chat_formatter(self):
        """The GGUF's chat template compiled once (Jinja2), with the model's bos/eos text."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        bos, eos = self.engine.special_token("bos"), self.engine.special_token("eos")
        return Jinja2ChatFormatter(self.chat_template,
                                   eos_token=self.engine.piece_text(eos) if eos is not None else "",
                                   bos_token=self.engine.piece_text(bos) if bos is not None else "")

    def render_chat(self, messages: list[dict]) -> list[int]:
        if not self.chat_template:
            raise PoolError("the model has no chat template", "use /v1/completions", status=400)
        res = self._chat_formatter(messages=messages)
        return self.engine.tokenize(res.prompt, not res.added_special, special=True)

    def adapters_for(self, model: str, extra: dict | None) -> dict[str, float]:
        """OpenAI ``model`` picks the adapter (the base by its own name); ``adapters`` mixes several."""
        if extra:
            return {check_name(k): float(v) for k, v in extra.items()}
        if model in ("", None, self.name):
            return {}
        return {check_name(model): 1.0}

    def close(self) -> None:
        self.engine.close()


def gen_request(prompt_tokens: list[int], adapters: dict[str, float], body: dict) -> GenerationRequest:
    temperature = body.get("temperature")
    return GenerationRequest(
        prompt_tokens=prompt_tokens, adapters=adapters, max_tokens=int(body.get("max_tokens") or 16),
        temperature=1.0 if temperature is None else float(temperature), top_p=float(body.get("top_p") or 1.0),
        seed=body.get("seed"), ignore_eos=bool(body.get("ignore_eos", False)))


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))
