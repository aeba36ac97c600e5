"""The fine-tune itself, in fp32: transformers (+ PEFT) logits and greedy tokens on the eval text,
cached by the hashes of the base, the adapter and the tokens."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tuneport.convert.adapter import resolve_adapter_path
from tuneport.convert.cache import cache_dir, write_once
from tuneport.convert.checkpoint import Checkpoint, checkpoint_sha256, resolve_model_path
from tuneport.convert.errors import UserError
from tuneport.convert.hashing import content_digest

from ..fidelity import load_hf, load_peft

log = logging.getLogger(__name__)
REFERENCE_VERSION = 2  # bump when what is cached changes

# The built-in eval text: prose, code, numbers, unicode, whitespace (offline, any model).
EVAL_CORPUS = """The river ran quietly past the old mill, and in the morning light the water looked almost silver.
She opened the window, listened to the birds for a while, and then went back to the letter she was writing.
Fine-tuning a language model with LoRA adds two small matrices to each adapted layer; merging them folds
the product back into the base weights, so the merged model runs at the base model's speed.

def moving_average(values, window=3):
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out

In 2023 the team measured 1,024 requests per second at a p99 latency of 38.5 ms; in 2024, 2,048.
Grüße aus München! Le café est très bon. 日本語の文章も少し。 Emoji: 🙂🚀.
    Indented text, with  double  spaces and a tab\there.
Q: What is the capital of France?
A: Paris is the capital of France.
"""


@dataclass
class Reference:
    """The reference's tokenizer and, for ``ids``, its logits ``[T, vocab]``, greedy continuation and,
    with an adapter, the base's logits (for the adapter's strength)."""

    tokenizer: object
    ids: list[int]
    logits: torch.Tensor
    greedy: list[int]
    base_logits: torch.Tensor | None


def load_tokenizer(base: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(base))


def eval_ids(tok, eval_file: Path | None, tokens: int) -> list[int]:
    if eval_file is not None:
        try:
            text = Path(eval_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --eval {eval_file} ({type(e).__name__})", "pass a UTF-8 text file") from e
    else:
        text = EVAL_CORPUS
    ids = tok(text).input_ids[:tokens]
    if len(ids) < 8:
        raise UserError(f"the eval text gives {len(ids)} tokens", "pass a longer --eval text (at least 8 tokens)")
    return ids


def _context(base: Path) -> int:
    """The positions the model was trained for (the eval text is cut to fit them, with one to spare)."""
    config = json.loads((base / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}  # a multimodal model's: its text model's
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 1 << 20)


def _key(base: Path, adapter: Path | None, ids: list[int], greedy_tokens: int) -> str:
    """The weights, config.json (the same weights under another config compute something else: a Granite's
    multipliers, a Qwen3-MoE's norm_topk_prob), the adapter, the tokens."""
    config = hashlib.sha256((base / "config.json").read_bytes()).hexdigest()
    h = hashlib.sha256(json.dumps({"base": checkpoint_sha256(Checkpoint(base)), "config": config,
                                   "v": REFERENCE_VERSION,
                                   "adapter": content_digest(adapter) if adapter else None, "ids": ids,
                                   "greedy": greedy_tokens}, sort_keys=True).encode())
    return h.hexdigest()[:24]


@torch.no_grad()
def _compute(base: Path, adapter: Path | None, ids: list[int], greedy_tokens: int) -> dict[str, torch.Tensor]:
    from ..fidelity import greedy, logits

    model = load_peft(base, adapter) if adapter else load_hf(base)
    t = torch.tensor([ids])
    out = {"logits": logits(model, t)[0].contiguous(),
           "greedy": torch.tensor(greedy(model, greedy_prompt(ids), greedy_tokens))}
    if adapter:
        with model.disable_adapter():
            out["base_logits"] = logits(model, t)[0].contiguous()
    return out


def greedy_prompt(ids: list[int]) -> list[int]:
    """The prompt of the greedy comparison: the eval text's first tokens."""
    return ids[: max(4, min(32, len(ids) // 2))]


def reference(base: str | Path, adapter: str | Path | None, eval_file: Path | None, tokens: int,
              greedy_tokens: int) -> Reference:
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    base_dir = resolve_model_path(base)
    adapter_dir = resolve_adapter_path(adapter) if adapter else None
    tok = load_tokenizer(base_dir)
    ids = eval_ids(tok, eval_file, min(tokens, _context(base_dir) - 1))
    entry = cache_dir() / "verify" / f"{_key(base_dir, adapter_dir, ids, greedy_tokens)}.safetensors"
    if not entry.exists():
        log.info("computing the fp32 reference (%s%s)", base_dir, f" + {adapter_dir}" if adapter_dir else "")
    write_once(entry, lambda tmp: save_file(_compute(base_dir, adapter_dir, ids, greedy_tokens), str(tmp)))
    saved = load_file(str(entry))
    return Reference(tok, ids, saved["logits"], saved["greedy"].tolist(), saved.get("base_logits"))
