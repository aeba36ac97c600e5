"""A small llama trained on real text, for quantization quality tests (AWQ vs round-to-nearest,
importance matrices): about 4.6M parameters, a byte-level BPE tokenizer and a few minutes of training on
the docstrings of Python's standard library, never on ``HELDOUT_MODULES``. Deterministic; built once and
kept under ``$TUNEPORT_FIXTURE_CACHE`` (default ``~/.cache/tuneport/fixtures``), keyed by its recipe."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tuneport.convert.cache import write_once
from tuneport.convert.calibration.text import CALIB_MODULES, HELDOUT_MODULES, stdlib_text

log = logging.getLogger(__name__)

EXTRA_TRAIN_MODULES = ("ast", "codecs", "configparser", "copy", "doctest", "email.utils", "fnmatch", "ftplib",
                       "getopt", "gettext", "glob", "imaplib", "locale", "mailbox", "numbers", "optparse", "os",
                       "platform", "poplib", "pydoc", "shelve", "signal", "ssl", "sysconfig", "trace", "types",
                       "xml.dom.minidom", "xml.etree.ElementTree", "zoneinfo", "cmd", "code", "dis", "filecmp",
                       "fileinput", "graphlib", "imaplib", "lzma", "bz2", "netrc", "plistlib", "pstats", "runpy",
                       "symtable", "tomllib", "unittest.mock", "urllib.request", "wsgiref.handlers", "xmlrpc.client")
TRAIN_MODULES = tuple(m for m in dict.fromkeys(CALIB_MODULES + EXTRA_TRAIN_MODULES) if m not in HELDOUT_MODULES)


@dataclass(frozen=True)
class TrainedRecipe:
    vocab: int = 1024
    hidden: int = 256  # rows of 256: every llama.cpp K- and IQ-quant applies
    intermediate: int = 768
    layers: int = 4
    heads: int = 4  # head dim 64; no GQA, so v_proj -> o_proj scales fold too
    seqlen: int = 128
    batch: int = 16
    steps: int = 400
    lr: float = 3e-3
    seed: int = 0
    version: int = 1


def fixture_cache() -> Path:
    return Path(os.environ.get("TUNEPORT_FIXTURE_CACHE", Path.home() / ".cache" / "tuneport" / "fixtures"))


def trained_llama(recipe: TrainedRecipe = TrainedRecipe()) -> Path:
    """The trained model's HF directory (built on first use)."""
    key = hashlib.sha256(json.dumps({**asdict(recipe), "modules": TRAIN_MODULES}).encode()).hexdigest()[:12]
    return write_once(fixture_cache() / f"trained-llama-{key}", lambda tmp: _build(recipe, tmp))


def _tokenizer(text: str, vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def _build(recipe: TrainedRecipe, out: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    started = time.time()
    out.mkdir(parents=True)
    text = stdlib_text(TRAIN_MODULES)
    tok = _tokenizer(text, recipe.vocab, out)
    ids = torch.tensor(tok(text)["input_ids"])
    torch.manual_seed(recipe.seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
                         num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
                         num_key_value_heads=recipe.heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(recipe.seed)
    model.train()
    for step in range(recipe.steps):
        starts = torch.randint(0, len(ids) - recipe.seqlen - 1, (recipe.batch,), generator=gen)
        batch = torch.stack([ids[s:s + recipe.seqlen] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 50 == 0 or step == recipe.steps - 1:
            log.info("trained llama: step %d loss %.3f", step, loss.item())
    model.eval()
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, do_sample=False).save_pretrained(out)
    (out / "training.json").write_text(json.dumps({**asdict(recipe), "final_loss": loss.item(),
                                                   "train_tokens": len(ids), "seconds": time.time() - started}))
