"""A GGUF file's own tokenizer, as llama.cpp runs it: tokenizing with its special tokens parsed, rendering its chat
template as ``tuneport serve`` does, its special ids and token types; and the check ``export --target gguf``
runs on the file it wrote (the checks ``tuneport verify`` runs), so a GGUF that tokenizes differently from the
HF tokenizer is never handed over with a silent exit 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..tokenizer_parity import (
    Check,
    chat_template_parity,
    detokenizer_parity,
    different_strings,
    special_token_types,
    special_tokens_parity,
    tokenizer_parity,
)
from .read import gguf_field, open_gguf
from .runtime import chat_renderer, llamacpp_logging

META_KEYS = ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
             "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")


class GGUFTokenizer:
    """The vocabulary of a GGUF model loaded alone in llama.cpp (``vocab_only``: no weights read)."""

    def __init__(self, model: Path, llm=None) -> None:
        import llama_cpp

        reader = open_gguf(model)
        self.meta = {k: gguf_field(reader, k) for k in META_KEYS}
        self.types = [int(t) for t in gguf_field(reader, "tokenizer.ggml.token_type") or []]
        self.owned = llm is None
        if llm is None:
            with llamacpp_logging():  # its log lines to logging, not stderr
                llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, n_ctx=16, verbose=False)
        self.llm = llm
        self._render = None

    def tokenize(self, text: str) -> list[int]:
        """With the file's own special tokens added (llama.cpp's add_special), as HF's ``tok(text)``."""
        return self.llm.tokenize(text.encode(), add_bos=True, special=True)

    def parse(self, text: str) -> list[int]:
        """Special tokens parsed, nothing added (no BOS)."""
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def detokenize(self, ids: list[int]) -> str:
        """The pieces joined, special tokens kept, as llama.cpp's server streams them; the first one without the
        space a SentencePiece vocabulary with ``add_space_prefix`` put before the text (llama.cpp's own
        ``llama_detokenize`` drops it, as HF's decode does; llama-cpp-python's ``detokenize`` keeps it)."""
        import ctypes

        import llama_cpp

        vocab, out = self.llm._model.vocab, b""
        strip = 1 if self.meta["tokenizer.ggml.add_space_prefix"] else 0
        for i, token in enumerate(ids):
            buf = ctypes.create_string_buffer(256)
            n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), strip if i == 0 else 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), strip if i == 0 else 0, True)
            out += buf.raw[:n]
        return out.decode("utf-8", "replace")

    def _text(self, key: str) -> str:
        tid = self.meta[key]
        return self.llm.detokenize([tid], special=True).decode("utf-8", "replace") if tid is not None else ""

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int] | None:
        """The file's chat template rendered as ``tuneport serve`` renders it (None: the file has none)."""
        if not self.meta["tokenizer.chat_template"]:
            return None
        if self._render is None:
            self._render = chat_renderer(self.meta["tokenizer.chat_template"],
                                         self._text("tokenizer.ggml.bos_token_id"),
                                         self._text("tokenizer.ggml.eos_token_id"))
        prompt, add_bos = self._render(messages, tools)
        return self.llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)

    def special_tokens(self) -> dict:
        return {"bos": self.meta["tokenizer.ggml.bos_token_id"], "eos": self.meta["tokenizer.ggml.eos_token_id"],
                "add_bos": bool(self.meta["tokenizer.ggml.add_bos_token"]),
                "add_eos": bool(self.meta["tokenizer.ggml.add_eos_token"])}

    def checks(self, tok) -> list[Check]:
        """Every parity check against the HF tokenizer ``tok``."""
        return [tokenizer_parity(self.tokenize, tok), detokenizer_parity(self.detokenize, tok),
                chat_template_parity(self.render_chat, tok),
                special_tokens_parity(self.special_tokens(), tok),
                special_token_types(self.types, self.parse, tok)]

    def close(self) -> None:
        if self.owned:
            self.llm.close()


@dataclass
class TokenizerReport:
    """What ``export --target gguf`` found when it checked the file it wrote."""

    checks: list[Check]
    different: list[str] = field(default_factory=list)  # battery strings llama.cpp tokenizes differently
    cause: str | None = None  # why llama.cpp cannot express this tokenizer, when tuneport knows

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def failure(self) -> str:
        failed = [c for c in self.checks if c.passed is False]
        shown = ", ".join(repr(s) for s in self.different[:3]) + (", ..." if len(self.different) > 3 else "")
        parts = [f"{len(self.different)} of the battery's strings tokenize differently ({shown})"] if self.different \
            else []
        parts += [f"{c.name}: {c.detail}" for c in failed if c.name != "tokenizer"]
        return "; ".join(parts) + (f" ({self.cause})" if self.cause else "")

    def as_dict(self) -> dict:
        return {"passed": self.passed, "cause": self.cause, "different_strings": self.different,
                **{c.name: c.as_dict() for c in self.checks}}


def check_gguf_tokenizer(model: Path, tok, cause: str | None = None) -> TokenizerReport | None:
    """Check ``model``'s tokenizer in llama.cpp against the HF tokenizer ``tok`` (None without llama-cpp-python)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    gguf_tok = GGUFTokenizer(model)
    try:
        return TokenizerReport(gguf_tok.checks(tok), different_strings(gguf_tok.tokenize, tok), cause)
    finally:
        gguf_tok.close()
