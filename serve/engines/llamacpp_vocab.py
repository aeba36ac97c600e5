"""The model's vocabulary and metadata as llama.cpp holds them: tokenize, token pieces, GGUF metadata, special
tokens."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .utf8 import Utf8Table


class Vocabulary:
    """The vocabulary and metadata (a part of :class:`~.llamacpp.LlamaCppEngine`, which holds the state)."""

    @functools.cached_property
    def _utf8(self) -> Utf8Table:
        """The vocabulary's UTF-8 shapes, built at the first constrained request."""
        ends = np.array([bool(self.lc.llama_vocab_is_eog(self.vocab, t)) for t in range(self.n_vocab)])
        return Utf8Table([self.piece(t) for t in range(self.n_vocab)], ends)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        lc = self.lc
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_bos, special)
        if n < 0:
            raise RuntimeError("tokenize buffer too small")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens rendered as empty)."""
        buf = ctypes.create_string_buffer(64)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def longest_piece(self) -> int:
        """The most bytes one token stands for in a prompt's text: its piece, special tokens' text included, or its
        vocabulary text where that is longer (a SentencePiece piece written with ▁, which a prompt may hold as is)."""
        buf = ctypes.create_string_buffer(256)
        longest = 1
        for token in range(self.n_vocab):
            n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            text = self.lc.llama_vocab_get_text(self.vocab, token) or b""
            longest = max(longest, n if n >= 0 else -n, len(text))  # negative: the piece needs -n bytes
        return longest

    def piece_text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def special_token(self, kind: str) -> int | None:
        fn = {"bos": self.lc.llama_vocab_bos, "eos": self.lc.llama_vocab_eos}[kind]
        tok = fn(self.vocab)
        return tok if tok >= 0 else None
