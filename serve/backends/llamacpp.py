"""The llama.cpp backend: tokens generated in this process by :class:`LlamaCppEngine`, answers built by
:class:`~tuneport.serve.backends.inprocess.InProcessBackend`.

``--base`` may be a GGUF file or an HF directory (converted once to GGUF and cached); adapters may be GGUF
LoRA files or PEFT directories (converted on load for an HF base, cached by content hash).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

from tuneport.convert.adapter import load_adapter
from tuneport.convert.arch import arch_for
from tuneport.convert.cache import cache_dir, write_once
from tuneport.convert.checkpoint import Checkpoint, resolve_model_path
from tuneport.convert.errors import UserError
from tuneport.convert.export import cached_export
from tuneport.convert.gguf.gpu import llamacpp_compute, n_gpu_layers
from tuneport.convert.gguf.lora import build_gguf_lora, write_gguf_lora
from tuneport.convert.gguf.quant_types import GGUF_FOR_DTYPE
from tuneport.convert.gguf.runtime import chat_renderer
from tuneport.convert.gguf.vocab import HF_TOKENIZER_DIR
from tuneport.convert.hashing import config_digest, content_digest
from tuneport.convert.inputs import adapter_for
from tuneport.convert.options import model_name
from tuneport.convert.targets import check_base

from ..engines.base import Event, GenerationRequest
from ..engines.hf_text import HfText
from ..engines.llamacpp import LlamaCppEngine
from ..errors import ApiError
from ..pool import PoolError
from .inprocess import InProcessBackend


class LlamaCppBackend(InProcessBackend):
    engine = "llamacpp"
    weighted_mixes = True

    def __init__(self, base: str | Path, *, max_adapters: int = 8, adapter_dir: Path | None = None,
                 n_ctx: int = 2048, contexts: int = 1, kv_f32: bool = False, dtype: str = "auto",
                 prompt_cache: bool = True, gpu_layers: int | str | None = None,
                 max_sets_per_batch: int | None = None, threads: int | None = None) -> None:
        name = model_name(base)  # from what the user gave: a hub id's name, not its snapshot's hash
        n_gpu = n_gpu_layers(gpu_layers)  # refused on a CPU build before any conversion
        base = resolve_model_path(base)
        self.hf_base: Path | None = None
        if base.is_dir():
            self.hf_base = base
            model_path = self._cached_gguf(base, GGUF_FOR_DTYPE[dtype])
        elif base.suffix == ".gguf" and base.is_file():
            _check_dtype("gguf", dtype)
            model_path = base
        else:
            raise UserError(f"--base {base} is neither a GGUF file nor a model directory", "pass one of them")
        # TUNEPORT_LLAMACPP_BATCH_ADAPTERS=0: the fallback (one adapter set per decode) even where llama.cpp has
        # per-sequence LoRA, to compare the two (benchmarks/serve_llamacpp.py)
        batched = os.environ.get("TUNEPORT_LLAMACPP_BATCH_ADAPTERS", "1") != "0"
        self.llama = LlamaCppEngine(model_path, n_ctx=n_ctx, n_contexts=contexts, kv_f32=kv_f32,
                                    prompt_cache=prompt_cache, n_gpu_layers=n_gpu, batch_adapter_sets=batched,
                                    max_sets_per_batch=max_sets_per_batch, n_threads=threads)
        super().__init__(name, max_adapters, adapter_dir)
        self.max_choices = self.llama.n_seq_max
        self.chat_template = self.llama.metadata("tokenizer.chat_template")
        self.add_bos = (self.llama.metadata("tokenizer.ggml.add_bos_token") or "true") == "true"
        self.hf_text = _hf_text_beside(model_path)

    @classmethod
    def check_options(cls, opts, fmt: str) -> None:
        _check_dtype(fmt, opts.dtype)

    @classmethod
    def from_options(cls, opts) -> LlamaCppBackend:
        return cls.start(opts, n_ctx=opts.n_ctx, contexts=opts.contexts, kv_f32=opts.kv_f32, dtype=opts.dtype,
                         prompt_cache=opts.prompt_cache, gpu_layers=opts.gpu_layers,
                         max_sets_per_batch=opts.max_sets_per_batch, threads=opts.threads)

    @staticmethod
    def _cached_gguf(hf_dir: Path, quant: str) -> Path:
        """The HF base as GGUF, converted once and cached by content; a tokenizer llama.cpp cannot express is
        accepted, as prompts are then tokenized by the HF tokenizer the export keeps beside the file."""
        out = cached_export(hf_dir, "gguf", quant=quant, name="model", accept_tokenizer_difference=True)
        return out / f"model-{quant.upper()}.gguf"

    # -- adapters ------------------------------------------------------------------------------------
    def attach_adapter(self, name: str, path: Path) -> int:
        if path.is_dir() and (path / "adapter_config.json").exists():
            path = self._convert_peft(path)
        elif path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise PoolError(f"{path} holds no single GGUF LoRA", "pass a .gguf file or a PEFT directory",
                                status=422)
            path = ggufs[0]
        try:
            return self.llama.load_adapter(name, path)
        except UserError as e:
            raise PoolError(e.message, e.hint, status=422) from e

    def detach_adapter(self, name: str) -> None:
        self.llama.unload_adapter(name)

    def _convert_peft(self, adapter_dir: Path) -> Path:
        if self.hf_base is None:
            raise PoolError(f"{adapter_dir} is a PEFT adapter; converting it needs the HF base",
                            "start with --base HF_DIR, or export GGUF LoRAs with tuneport export --target gguf",
                            status=422)
        # keyed by the base's config too: the GGUF LoRA carries its architecture and is planned from its config
        out = cache_dir() / "loras" / f"{content_digest(adapter_dir)}-{config_digest(self.hf_base)}.gguf"
        if not out.exists():
            try:
                full = Checkpoint(self.hf_base)  # its own reader: conversions run in parallel threads
                ck = check_base(full, "gguf")  # a multimodal model's text view
                arch = arch_for(ck.model_type)
                lora = build_gguf_lora(adapter_for(load_adapter(adapter_dir), full, ck, "gguf"), ck, arch)
            except UserError as e:
                raise PoolError(e.message, e.hint, status=422) from e
            write_once(out, lambda tmp: write_gguf_lora(tmp, lora, adapter_dir.name))
        return out

    # -- requests ------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        add_bos = self.add_bos if add_bos is None else add_bos
        if self.hf_text is not None:  # the GGUF's vocabulary tokenizes some texts differently: HF's ids, as exported
            bos = self.llama.special_token("bos")
            return ([bos] if add_bos and bos is not None else []) + self.hf_text.encode(text, special=False)
        return self.llama.tokenize(text, add_bos, special=True)

    @functools.cached_property
    def _chat_renderer(self):
        """The GGUF's chat template compiled once, with the model's bos/eos text."""
        bos, eos = self.llama.special_token("bos"), self.llama.special_token("eos")
        return chat_renderer(self.chat_template, self.llama.piece_text(bos) if bos is not None else "",
                             self.llama.piece_text(eos) if eos is not None else "")

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, bool]:
        if not self.chat_template:
            raise ApiError("the model has no chat template", "use /v1/completions")
        try:
            return self._chat_renderer(messages, tools)
        except Exception as e:  # noqa: BLE001 - a template error is the request's (jinja, bad message shapes)
            raise ApiError(f"the chat template cannot render these messages: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self.llama.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.llama.n_ctx

    def token_bytes_bound(self) -> int:
        return self.llama.longest_piece()

    def piece(self, token: int) -> bytes:
        return self.llama.piece(token)

    def run(self, request: GenerationRequest) -> Iterator[Event]:
        return self.llama.events(request)

    # -- state ---------------------------------------------------------------------------------------
    def health(self) -> bool:
        return self.llama.model is not None

    def describe(self) -> dict:
        return {**super().describe(), "gguf": str(self.llama.model_path), "n_ctx": self.llama.n_ctx,
                "tokenizer": "hf (the GGUF's vocabulary differs)" if self.hf_text is not None else "gguf",
                "contexts": self.llama.n_contexts, "threads": self.llama.n_threads,
                "prompt_cache": self.llama.prompt_cache, "gpu_layers": self.llama.n_gpu_layers,
                "compute": llamacpp_compute().label, "adapter_batching": self.llama.adapter_batching,
                **({"max_sets_per_batch": self.llama.max_sets_per_batch} if self.llama.seq_lora else {})}

    def counters(self) -> dict[str, int]:
        # which path decodes mixed adapter traffic: 1 every set in one batch (per-sequence LoRA), 0 the fallback
        return {**self.llama.cache_stats, "llamacpp_per_sequence_lora": int(self.llama.seq_lora is not None),
                "llamacpp_max_batch_adapter_sets": self.llama.max_batch_adapter_sets}

    def close(self) -> None:
        self.llama.close()


def _check_dtype(fmt: str, dtype: str) -> None:
    if fmt == "gguf" and dtype != "auto":
        raise UserError(f"--dtype {dtype} applies to an HF base (the GGUF it is converted to)",
                        "drop --dtype: a GGUF file is served with its own types")


def _hf_text_beside(model_path: Path) -> HfText | None:
    """The HF tokenizer ``export --target gguf --accept-tokenizer-difference`` keeps beside a GGUF whose vocabulary
    tokenizes differently (None: there is none, llama.cpp's own tokenizer is exact)."""
    tok_dir = model_path.parent / HF_TOKENIZER_DIR
    if not tok_dir.is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return HfText(AutoTokenizer.from_pretrained(tok_dir))
    except Exception as e:  # noqa: BLE001 - any loader error: the files beside the GGUF are broken
        raise UserError(f"cannot load the HF tokenizer in {tok_dir} ({type(e).__name__}: {str(e)[:120]})",
                        "re-export the GGUF, or remove that directory to tokenize with llama.cpp's vocabulary") from e
