"""Which tokens keep a constrained output valid UTF-8 text.

A grammar over characters cannot see a token that is a lone byte of a multi-byte character: byte-level
vocabularies have one per byte, and a grammar would count a stray continuation byte as a character. With a
grammar the output must be text (JSON is UTF-8), so each step also masks the tokens whose bytes cannot continue
the text so far, and control tokens (no text in the answer, their special text in the grammar's eyes). A
:class:`Utf8Table` knows, per token, its leading continuation bytes, whether the rest is well formed, and how
many continuation bytes its last character still needs.
"""

from __future__ import annotations

import numpy as np


def _shape(b: bytes) -> tuple[int, bool, bool, int]:
    """(leading continuation bytes, all continuation, the rest well formed, continuation bytes still needed)."""
    lead = 0
    while lead < len(b) and 0x80 <= b[lead] < 0xC0:
        lead += 1
    if lead == len(b):
        return lead, True, True, 0
    i, need = lead, 0
    while i < len(b):
        c = b[i]
        width = 1 if c < 0x80 else 2 if 0xC2 <= c < 0xE0 else 3 if 0xE0 <= c < 0xF0 else 4 if 0xF0 <= c < 0xF5 else 0
        if width == 0:
            return lead, False, False, 0
        body = b[i + 1: i + width]
        if any(not 0x80 <= x < 0xC0 for x in body):
            return lead, False, False, 0
        if len(body) < width - 1:
            need = width - 1 - len(body)
        i += width
    return lead, False, True, need


class Utf8Table:
    """Per-token UTF-8 shape of a vocabulary, for masking a row of logits in one vectorised step."""

    def __init__(self, pieces: list[bytes], ends: np.ndarray | None = None) -> None:
        """``ends``: the end-of-generation tokens; other tokens with no text (control tokens) are masked, since a
        grammar matches them by their special text, which the answer never shows."""
        shapes = [_shape(p) for p in pieces]
        empty = np.array([not p for p in pieces])
        self.silent = empty & ~(ends if ends is not None else np.zeros_like(empty))
        self.lead = np.array([s[0] for s in shapes], dtype=np.int8)
        self.all_cont = np.array([s[1] for s in shapes])
        self.ok = np.array([s[2] for s in shapes])
        self.need = np.array([s[3] for s in shapes], dtype=np.int8)

    def allowed(self, pending: int) -> np.ndarray:
        """Tokens that may follow text still ``pending`` continuation bytes short of a whole character."""
        return np.where(self.all_cont, self.lead <= pending, (self.lead == pending) & self.ok) & ~self.silent

    def after(self, pending: int, token: int) -> int:
        """Continuation bytes still needed once ``token`` is appended."""
        return pending - int(self.lead[token]) if self.all_cont[token] else int(self.need[token])
