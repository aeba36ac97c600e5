"""A GGUF model (and optionally a GGUF LoRA on it) run in llama.cpp for verification: F32 KV cache,
flash attention off, logits at every position; its own tokenizer, chat template and special ids."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.read import gguf_field, is_lora, open_gguf
from tuneport.convert.gguf.runtime import chat_renderer

from ..fidelity import llamacpp_logits, llamacpp_model


class GGUFRunner:
    engine = "llama.cpp"
    exact_logits = True  # logits, so max |Δlogit| is measured

    def __init__(self, model: Path, lora: Path | None, n_ctx: int) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise UserError("verifying a GGUF file needs llama-cpp-python", "pip install 'tuneport[llamacpp]'") from e
        reader = open_gguf(model)
        if is_lora(reader):
            raise UserError(f"{model.name} is a GGUF LoRA, not a model",
                            "pass the model file as ARTIFACT and the LoRA with --lora")
        if lora is not None and not is_lora(open_gguf(lora)):
            raise UserError(f"--lora {lora.name} is not a GGUF LoRA", "pass a file written as a GGUF adapter")
        self.meta = {k: gguf_field(reader, k) for k in (
            "tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")}
        self.llm = llamacpp_model(model, lora, n_ctx=n_ctx)
        self.plain = llamacpp_model(model, None, n_ctx=n_ctx) if lora is not None else None

    def logits(self, ids: list[int], with_lora: bool = True) -> torch.Tensor:
        return llamacpp_logits(self.llm if with_lora or self.plain is None else self.plain, ids)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        out: list[int] = []
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            llm.eval([tok])
        return out

    def tokenize(self, text: str) -> list[int]:
        """With the file's own special tokens added (llama.cpp's add_special), as HF's ``tok(text)``."""
        return self.llm.tokenize(text.encode(), add_bos=True, special=True)

    @functools.cached_property
    def _chat_renderer(self):
        def text(key: str) -> str:
            tid = self.meta[key]
            return self.llm.detokenize([tid], special=True).decode("utf-8", "replace") if tid is not None else ""

        return chat_renderer(self.meta["tokenizer.chat_template"], text("tokenizer.ggml.bos_token_id"),
                             text("tokenizer.ggml.eos_token_id"))

    def render_chat(self, messages: list[dict]) -> list[int] | None:
        """The GGUF's chat template rendered as ``tuneport serve`` renders it (None: the file has none)."""
        if not self.meta["tokenizer.chat_template"]:
            return None
        prompt, add_bos = self._chat_renderer(messages)
        return self.llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)

    def special_tokens(self) -> dict:
        return {"bos": self.meta["tokenizer.ggml.bos_token_id"], "eos": self.meta["tokenizer.ggml.eos_token_id"],
                "add_bos": bool(self.meta["tokenizer.ggml.add_bos_token"]),
                "add_eos": bool(self.meta["tokenizer.ggml.add_eos_token"])}

    def close(self) -> None:
        self.llm.close()
        if self.plain is not None:
            self.plain.close()
