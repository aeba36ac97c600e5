"""A GGUF model (and optionally a GGUF LoRA on it) run in llama.cpp for verification: F32 KV cache,
flash attention off, logits at every position; its own tokenizer, chat template and special ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.gpu import n_gpu_layers
from tuneport.convert.gguf.read import is_lora, open_gguf
from tuneport.convert.gguf.tokenizer_check import GGUFTokenizer

from ..fidelity import llamacpp_logits, llamacpp_model


class GGUFRunner:
    engine = "llama.cpp"
    exact_logits = True  # logits, so max |Δlogit| is measured
    engine_options = ("gpu_layers",)  # VerifyOptions fields only this runner takes

    def __init__(self, model: Path, lora: Path | None, n_ctx: int, gpu_layers: int | str | None = None) -> None:
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
        n_gpu = n_gpu_layers(gpu_layers)
        self.llm = llamacpp_model(model, lora, n_ctx=n_ctx, n_gpu_layers=n_gpu)
        self.vocab = GGUFTokenizer(model, self.llm)  # its tokenizer, chat template and special ids
        self.plain = llamacpp_model(model, None, n_ctx=n_ctx, n_gpu_layers=n_gpu) if lora is not None else None

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
        return self.vocab.tokenize(text)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int] | None:
        return self.vocab.render_chat(messages, tools)

    def special_tokens(self) -> dict:
        return self.vocab.special_tokens()

    def close(self) -> None:
        self.llm.close()
        if self.plain is not None:
            self.plain.close()
