"""Text in and out of a Hugging Face tokenizer for an in-process engine: prompts, the chat template, and
the bytes each generated token adds (what llama.cpp's ``token_to_piece`` gives for a GGUF vocabulary).

Token bytes follow the tokenizer's decoder: byte-level BPE maps each character back to its byte;
SentencePiece-style vocabularies turn ``▁`` into a space and ``<0xNN>`` into the byte; special tokens
add nothing. A generated token keeps its leading space (a continuation, not the start of a text).
Calls into the tokenizer are serialized: a fast tokenizer is not safe to use from several threads.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

from ..errors import ApiError

SPM_SPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def decoder_kind(tokenizer) -> str:
    """"bytelevel", "spm" or "other", from the fast tokenizer's decoder (a slow SentencePiece one: "spm")."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "spm" if hasattr(tokenizer, "sp_model") else "other"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "Metaspace" in kinds or "ByteFallback" in kinds or any(
            d.get("type") == "Replace" and SPM_SPACE in json.dumps(d.get("pattern")) for d in
            decoder.get("decoders", [decoder])):
        return "spm"
    return "other"


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes of every token id (special tokens: empty)."""
    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                if getattr(t, "special", False)}
    kind = decoder_kind(tokenizer)
    table = []
    for i, t in enumerate(tokens):
        if i in special or t is None:
            table.append(b"")
        elif kind == "bytelevel":
            dec = _byte_decoder()
            table.append(b"".join(bytes([dec[c]]) if c in dec else c.encode() for c in t))
        elif kind == "spm" and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            table.append(bytes([int(t[3:5], 16)]))
        elif kind == "spm":
            table.append(t.replace(SPM_SPACE, " ").encode())
        else:
            table.append(tokenizer.decode([i]).encode())
    return table


def tokenizer_file_bound(path: Path) -> int | None:
    """:meth:`HfText.token_bytes_bound` of a ``tokenizer.json`` read as JSON, without building a tokenizer (None
    when there is no such file or it holds no vocabulary)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = (data.get("model") or {}).get("vocab") or {}
    pieces = list(vocab) if isinstance(vocab, dict) else [v[0] for v in vocab if isinstance(v, list) and v]
    pieces += [t.get("content", "") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    return max((len(str(p).encode()) for p in pieces), default=0) or None


class HfText:
    """Prompts, chat and token bytes of one HF tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self.pieces = token_bytes(tokenizer)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special``: add BOS/EOS as the tokenizer's config says (a completion prompt)."""
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=special))

    def chat(self, messages: list[dict]) -> str:
        """The messages through the chat template (with the generation prompt), as text; it writes BOS itself, so
        it is encoded with ``special=False``."""
        if not self.chat_template:
            raise ApiError("the model has no chat template", "use /v1/completions")
        try:
            with self._lock:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template error is the request's (jinja, bad message shapes)
            raise ApiError(f"the chat template cannot render these messages: {e}") from e

    def token_bytes_bound(self) -> int:
        """An upper bound on the bytes one token stands for: its vocabulary string in UTF-8 (a byte-level
        character, ``▁`` or ``<0xNN>`` is at least as long as the byte it means), special tokens included."""
        with self._lock:
            tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            tokens += list(self.tokenizer.get_added_vocab())
        return max(len(t.encode()) for t in tokens if t is not None)

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""
