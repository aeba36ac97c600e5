"""An MLX LM directory (and optionally an mlx-lm adapter on it) run in mlx-lm for verification: fp32
logits at every position from mlx-lm's own model classes, its tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tuneport.convert.errors import UserError
from tuneport.convert.mlx import INSTALL_HINT
from tuneport.convert.mlx.read import is_mlx_adapter


def mlx_logits(model, ids: list[int]) -> torch.Tensor:
    """``[T, vocab]`` fp32 logits of ``model`` (an mlx-lm model) for one sequence."""
    import mlx.core as mx

    out = model(mx.array([ids]))[0].astype(mx.float32)
    return torch.from_numpy(np.array(out))


def load_mlx(model_dir: Path, adapter: Path | None = None):
    """mlx-lm's ``load``: (model, tokenizer wrapper), the adapter applied as mlx-lm applies it."""
    try:
        from mlx_lm.utils import load
    except ImportError as e:
        raise UserError("verifying an MLX model needs mlx and mlx-lm", INSTALL_HINT) from e
    return load(str(model_dir), adapter_path=str(adapter) if adapter else None)


class MlxRunner:
    engine = "mlx-lm"
    exact_logits = True

    def __init__(self, model: Path, lora: Path | None, n_ctx: int) -> None:
        if lora is not None and not is_mlx_adapter(lora):
            raise UserError(f"--lora {lora} is not an mlx-lm adapter",
                            "pass a directory with adapters.safetensors and adapter_config.json "
                            "(tuneport export --target mlx --adapters separate writes them)")
        self.model, self.tokenizer = load_mlx(model, lora)
        self.plain = load_mlx(model)[0] if lora is not None else None

    def logits(self, ids: list[int], with_lora: bool = True) -> torch.Tensor:
        return mlx_logits(self.model if with_lora or self.plain is None else self.plain, ids)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array([prompt]), cache=cache)
        out: list[int] = []
        for _ in range(n):
            tok = int(mx.argmax(logits[0, -1]).item())
            out.append(tok)
            logits = self.model(mx.array([[tok]]), cache=cache)
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer._tokenizer(text).input_ids)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int] | None:
        tok = self.tokenizer._tokenizer
        if not tok.chat_template:
            return None
        return list(tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                            return_dict=False))

    def special_tokens(self) -> dict:
        tok = self.tokenizer._tokenizer
        probe = tok("a").input_ids
        return {"bos": tok.bos_token_id, "eos": tok.eos_token_id,
                "add_bos": bool(probe) and tok.bos_token_id is not None and probe[0] == tok.bos_token_id,
                "add_eos": bool(probe) and tok.eos_token_id is not None and probe[-1] == tok.eos_token_id}

    def close(self) -> None:
        self.model = self.plain = None
