"""Train a small LoRA adapter with PEFT on a chat model, on CPU, in about a minute; cached by content hash.

The loss covers the assistant's answer only (the prompt is rendered with the model's chat template).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tuneport.convert.cache import write_once
from tuneport.convert.errors import UserError

log = logging.getLogger(__name__)

TRAIN_VERSION = 1  # bump when the training loop changes (part of the cache key)


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    steps: int = 16
    batch_size: int = 8
    learning_rate: float = 2e-3
    seed: int = 0
    threads: int = 2


def cache_key(base: Path, pairs: list[tuple[str, str]], config: TrainConfig) -> str:
    h = hashlib.sha256()
    source = base / "tuneport-source.json"
    h.update((source.read_text() if source.exists() else str(base.resolve())).encode())
    h.update(json.dumps({"pairs": pairs, "config": asdict(config), "v": TRAIN_VERSION}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _examples(tok, pairs: list[tuple[str, str]]):
    """(input ids, labels) per pair: labels are -100 on the prompt."""
    out = []
    for q, a in pairs:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        full = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                       tokenize=True, return_dict=True)["input_ids"]
        if full[: len(prompt)] != prompt:
            raise UserError("the chat template renders a prompt differently once an answer follows it",
                            "train on a model whose chat template renders each turn the same way")
        answer = full[len(prompt):]
        answer = answer[: answer.index(tok.eos_token_id) + 1] if tok.eos_token_id in answer else answer
        out.append((prompt + answer, [-100] * len(prompt) + answer))
    return out


def _train(base: Path, pairs: list[tuple[str, str]], config: TrainConfig, out: Path,
           progress: Callable[[int, int, float], None] | None) -> None:
    """Train with ``config.threads`` threads and a seeded generator; the caller's settings are restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            _train_loop(base, pairs, config, out, progress)
    finally:
        torch.set_num_threads(threads)


def _train_loop(base: Path, pairs: list[tuple[str, str]], config: TrainConfig, out: Path,
                progress: Callable[[int, int, float], None] | None) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0,
                                             target_modules=list(config.target_modules), task_type="CAUSAL_LM"))
    examples = _examples(tok, pairs)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(config.seed)
    model.train()
    for step in range(config.steps):
        idx = torch.randperm(len(examples), generator=gen)[: config.batch_size].tolist()
        batch = [examples[i] for i in idx]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if progress:
            progress(step + 1, config.steps, loss.item())
    model.save_pretrained(out)


def adapters_root(base: Path) -> Path:
    """Where the adapters trained on ``base`` are cached (beside it: rebuilding the base drops them)."""
    return base.parent / "adapters"


def adapter_dir(base: Path, pairs: list[tuple[str, str]], out_root: Path, name: str,
                config: TrainConfig = TrainConfig()) -> Path:
    """Where :func:`train_lora` keeps the adapter for this base, data and config."""
    return out_root / f"{name}-{cache_key(base, pairs, config)}"


def train_lora(base: Path, pairs: list[tuple[str, str]], out_root: Path, name: str,
               config: TrainConfig = TrainConfig(),
               progress: Callable[[int, int, float], None] | None = None) -> Path:
    """A PEFT LoRA adapter dir trained on ``pairs`` (question, answer); reused when one with the same base,
    data and config exists under ``out_root``."""
    out = adapter_dir(base, pairs, out_root, name, config)
    if not out.exists():
        log.info("training the %s adapter on %s", name, base)
    return write_once(out, lambda tmp: _train(base, pairs, config, tmp, progress))
