"""Calibration text: a user's file (plain text or jsonl) or a built-in default that needs no network —
the docstrings of Python's standard library, gathered at run time — cut into fixed-length token samples
chosen with a fixed seed."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 128
DEFAULT_SEQLEN = 512
SEED = 0
# The built-in calibration text: docstrings of these modules (and of their classes and functions).
CALIB_MODULES = ("argparse", "asyncio.tasks", "collections", "concurrent.futures", "contextlib", "csv",
                 "dataclasses", "datetime", "decimal", "email.message", "enum", "fractions", "functools",
                 "heapq", "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "pathlib",
                 "pickle", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string",
                 "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest.case", "urllib.parse",
                 "uuid", "zipfile")
# Modules kept out of every calibration and training set, for held-out evaluation.
HELDOUT_MODULES = ("bisect", "calendar", "difflib", "gzip", "hashlib", "mimetypes", "operator", "pprint",
                   "queue", "sched", "secrets", "selectors", "shlex", "smtplib", "struct", "tempfile",
                   "timeit", "tokenize", "traceback", "weakref")


def stdlib_text(modules: tuple[str, ...] = CALIB_MODULES) -> str:
    """The docstrings of ``modules`` and their public classes, methods and functions, in a fixed order."""
    docs: list[str] = []
    with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when their docs are read
        warnings.simplefilter("ignore", DeprecationWarning)
        _collect(modules, docs)
    return "\n\n".join(d for d in dict.fromkeys(docs) if len(d) > 40)


def _collect(modules: tuple[str, ...], docs: list[str]) -> None:
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a stripped-down Python: use what is there
            continue
        docs.append(inspect.getdoc(mod) or "")
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for mname, member in sorted(vars(obj).items()):
                    if not mname.startswith("_") and inspect.isfunction(member):
                        docs.append(inspect.getdoc(member) or "")


def read_calib_file(path: Path) -> str:
    """Plain text as is; ``.jsonl``: one JSON object per line, its ``text`` field (or a bare string)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--calib {path}: no such file", "pass a plain-text or .jsonl file")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--calib {path} is not UTF-8 text", "pass a plain-text or .jsonl file") from None
    if path.suffix != ".jsonl":
        return raw
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"--calib {path} line {n} is not JSON", "write one JSON object per line") from None
        text = row if isinstance(row, str) else row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise UserError(f"--calib {path} line {n} has no \"text\" string", 'write {"text": "..."} per line')
        texts.append(text)
    return "\n\n".join(texts)


@dataclass
class Calibration:
    """Token samples ``[n, seqlen]`` and where they came from (for the manifest)."""

    ids: torch.Tensor
    source: str
    sha256: str

    def describe(self) -> dict:
        return {"source": self.source, "sha256": self.sha256, "samples": int(self.ids.shape[0]),
                "seqlen": int(self.ids.shape[1])}


def token_chunks(tokenizer, text: str, seqlen: int) -> list[list[int]]:
    """The text tokenized once and cut into consecutive ``seqlen`` chunks; where the tokenizer adds a BOS,
    each chunk starts with it (as llama.cpp's ``llama-imatrix`` does)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    chunks = [ids[i:i + seqlen] for i in range(0, len(ids) - seqlen + 1, seqlen)]
    if adds_bos:
        chunks = [[bos, *c[1:]] for c in chunks]
    return chunks


def load_calibration(tokenizer, calib: Path | None, samples: int | None, seqlen: int | None,
                     max_len: int | None = None) -> Calibration:
    samples = DEFAULT_SAMPLES if samples is None else samples
    seqlen = min(DEFAULT_SEQLEN, max_len or DEFAULT_SEQLEN) if seqlen is None else seqlen
    if samples < 1 or seqlen < 2:
        raise UserError("--calib-samples must be >= 1 and --calib-seqlen >= 2", "pass positive sizes")
    if max_len and seqlen > max_len:
        raise UserError(f"--calib-seqlen {seqlen} exceeds the model's context ({max_len})",
                        f"pass --calib-seqlen {max_len} or less")
    text = read_calib_file(calib) if calib else stdlib_text()
    source = str(calib) if calib else "python-stdlib-docstrings"
    chunks = token_chunks(tokenizer, text, seqlen)
    if not chunks:
        raise UserError(f"the calibration text is shorter than --calib-seqlen {seqlen} tokens",
                        "pass a longer --calib file or a smaller --calib-seqlen")
    if len(chunks) > samples:
        chunks = [chunks[i] for i in sorted(random.Random(SEED).sample(range(len(chunks)), samples))]
    elif len(chunks) < samples:
        log.warning("calibration text gives %d samples of %d tokens (asked for %d)", len(chunks), seqlen, samples)
    return Calibration(torch.tensor(chunks, dtype=torch.long), source,
                       hashlib.sha256(text.encode()).hexdigest())
