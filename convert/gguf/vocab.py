"""Tokenizer -> GGUF vocabulary: SentencePiece as ``llama`` (from tokenizer.model, or from tokenizer.json alone as
transformers 5 saves it), byte-level BPE as ``gpt2``.

Token types, special ids and add_bos/add_eos are taken from the tokenizer itself (loaded with
transformers), so what llama.cpp does with the file matches what HF does with the directory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

# Where export keeps the HF tokenizer beside a GGUF whose vocabulary tokenizes some texts differently (accepted
# with --accept-tokenizer-difference): tuneport serve tokenizes prompts with it.
HF_TOKENIZER_DIR = "hf-tokenizer"

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 / 3.6: Qwen2's with combining marks kept in words (transformers' Qwen3_5Tokenizer sets it whatever the file
# holds; llama.cpp's "qwen35")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Byte-level BPE pre-tokenizers llama.cpp knows, by the HF steps that run before ByteLevel (with
# use_regex=True, GPT-2's built-in regex): ("Split", regex) or ("Digits", individual_digits).
BPE_PRE_STEPS: dict[str, tuple[tuple, ...]] = {
    "qwen2": (("Split", QWEN2_SPLIT),),
    "qwen35": (("Split", QWEN35_SPLIT),),
    "llama-bpe": (("Split", LLAMA3_SPLIT),),
    "gpt-2": (),
    "smollm": (("Digits", True),),  # SmolLM/SmolLM2 (llama.cpp: \p{N} split, then GPT-2's regex)
    "tekken": (("Split", TEKKEN_SPLIT),),  # Mistral Nemo, Small 3 (tekken.json converted by transformers)
    "gpt-4o": (("Split", GPT4O_SPLIT),),  # o200k: gpt-oss
}
BPE_PRE_BY_STEPS = {steps: name for name, steps in BPE_PRE_STEPS.items()}
KNOWN_BPE_PRE = ("qwen2", "qwen35", "llama-bpe", "llama3", "gpt-2", "default", "deepseek-llm", "deepseek-coder",
                 "falcon", "mpt", "starcoder", "refact", "command-r", "smollm", "tekken", "gpt-4o", "olmo", "dbrx")


@dataclass
class GGUFVocab:
    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    # why llama.cpp cannot run this tokenizer exactly as transformers does (None: it can, as far as tuneport knows)
    inexact: str | None = None
    rstrip: str = "none"  # HF's added tokens that strip the whitespace after them: "none", "all" or "mixed"

    def write(self, writer) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.merges:
            writer.add_token_merges(self.merges)
        elif self.merges is not None:  # llama.cpp refuses a BPE vocabulary without the key, even one of no merges
            import gguf

            writer.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.STRING)
        setters = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
                   "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
        for kind, tid in self.special.items():
            setters[kind](tid)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


# llama.cpp (llama-vocab.cpp) strips the whitespace after every special token but these when the model's
# general.name contains "phi-3" or "phi3" (Phi-3's tokenizer does), and after none otherwise.
PHI3_NAMES = ("phi-3", "phi3")
PHI3_UNSTRIPPED = ("<unk>", "<s>", "<|endoftext|>", "</s>")


def general_name(name: str, vocab: GGUFVocab) -> tuple[str, str | None]:
    """The ``general.name`` to write, and a note when it differs from ``name``: llama.cpp decides by the name
    whether special tokens strip the whitespace after them, so the name must say what the HF tokenizer does."""
    says_phi3 = any(p in name.lower() for p in PHI3_NAMES)
    if says_phi3 and vocab.rstrip == "none":
        safe = re.sub(r"phi-?3", "phi_3", name, flags=re.IGNORECASE)
        return safe, (f"general.name {safe!r}, not {name!r}: llama.cpp would strip the space after every special "
                      "token of a model whose name contains phi3, which this tokenizer does not")
    if not says_phi3 and vocab.rstrip == "all":
        return f"{name}-phi3", (f"general.name {name}-phi3: llama.cpp strips the space after special tokens, as "
                                "this tokenizer does, only for a model whose name contains phi3")
    return name, None


def _unreadable(shown: Path, e: Exception) -> UserError:
    return UserError(f"cannot load the tokenizer in {shown} ({type(e).__name__}: {str(e)[:120]})",
                     "the model directory needs its tokenizer files")


def _hf_tokenizer(model_dir: Path, shown: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise UserError("reading the tokenizer needs transformers", "pip install 'tuneport[hf]'") from e
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise _unreadable(shown, e) from e


def _common(tok, vocab: GGUFVocab, n_vocab: int) -> None:
    for kind in ("bos", "eos", "unk", "pad"):
        tid = getattr(tok, f"{kind}_token_id", None)
        if isinstance(tid, int) and 0 <= tid < n_vocab:
            vocab.special[kind] = tid
    probe = tok("a").input_ids
    vocab.add_bos = bool(probe) and "bos" in vocab.special and probe[0] == vocab.special["bos"]
    vocab.add_eos = bool(probe) and "eos" in vocab.special and probe[-1] == vocab.special["eos"]
    vocab.chat_template = tok.chat_template if isinstance(tok.chat_template, str) else None
    stripping = {bool(getattr(a, "rstrip", False)) for t, a in tok.added_tokens_decoder.items()
                 if t < n_vocab and a.content not in PHI3_UNSTRIPPED}
    vocab.rstrip = "mixed" if len(stripping) > 1 else "all" if stripping == {True} else "none"
    for tid, added in tok.added_tokens_decoder.items():
        if tid >= n_vocab:
            continue
        vocab.tokens[tid] = added.content
        vocab.types[tid] = CONTROL if added.special else USER_DEFINED
        if vocab.scores is not None:
            vocab.scores[tid] = -1000.0


def effective_pipeline(tok, model_dir: Path) -> dict:
    """The tokenizer.json transformers actually runs: its live backend (transformers 5's tokenizer classes rebuild
    the pre-tokenizer from their own options, whatever the file says), else the file."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return json.loads(backend.to_str())
    path = model_dir / "tokenizer.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _steps(part: dict | None, key: str) -> list[dict]:
    if not part:
        return []
    return list(part.get(key, [])) if part.get("type") == "Sequence" else [part]


def space_prefix(pipeline: dict, dummy_prefix: bool) -> tuple[bool, str | None]:
    """How HF puts the SentencePiece space before text, as llama.cpp's ``add_space_prefix``: (the flag, and why
    llama.cpp cannot match it exactly, or None). llama.cpp prefixes the start and the text after every special
    token, unconditionally: what a ``Prepend("▁")`` normalizer does. transformers' ``Metaspace`` prefixes only text
    that does not start with a space, and with ``prepend_scheme`` first only at the very start."""
    if any(s.get("type") == "Prepend" for s in _steps(pipeline.get("normalizer"), "normalizers")):
        return True, None
    meta = [s for s in _steps(pipeline.get("pre_tokenizer"), "pretokenizers") if s.get("type") == "Metaspace"]
    if meta:
        scheme = meta[0].get("prepend_scheme", "always" if meta[0].get("add_prefix_space", True) else "never")
        if scheme == "never":
            return False, None
        after = "nor after special tokens" if scheme == "first" else "and none after a special token before text " \
                                                                      "that starts with a space"
        return True, (f"llama.cpp puts a space before the text at the start and after every special token; this "
                      f"tokenizer (transformers' Metaspace, prepend_scheme {scheme!r}) puts none before text that "
                      f"starts with one, {after}")
    return (dummy_prefix, None) if not pipeline else (False, None)


def _sentencepiece(model_dir: Path, tok, n_vocab: int, live: dict) -> GGUFVocab:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [UNUSED] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i] = sp.IdToPiece(i)
        scores[i] = sp.GetScore(i)
        types[i] = (UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else UNUSED if sp.IsUnused(i)
                    else BYTE if sp.IsByte(i) else NORMAL)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((model_dir / "tokenizer.model").read_bytes())
    prefix, inexact = space_prefix(live, bool(proto.normalizer_spec.add_dummy_prefix))
    vocab = GGUFVocab("llama", "default", tokens, types, scores=scores, add_space_prefix=prefix, inexact=inexact)
    _common(tok, vocab, n_vocab)
    return vocab


def is_sentencepiece_json(tj: dict) -> bool:
    """A tokenizer.json that transformers converted from (or saves instead of) a SentencePiece model: BPE with byte
    fallback or ▁ for spaces and no byte-level step, or Unigram."""
    model, pipeline = tj.get("model") or {}, _steps(tj.get("pre_tokenizer"), "pretokenizers")
    if any(st.get("type") == "ByteLevel" for st in pipeline):
        return False
    if model.get("type") == "Unigram":
        return True
    return model.get("type") == "BPE" and (bool(model.get("byte_fallback")) or any(
        st.get("type") == "Metaspace" for st in pipeline) or "▁" in json.dumps(tj.get("normalizer")))


def merge_scores(merges: list) -> dict[str, float]:
    """SentencePiece scores from a BPE merge list: the k-th distinct merge result scores -k. llama.cpp merges the
    adjacent pair whose result scores highest, so it applies the merges in the order HF's BPE does. (From a
    SentencePiece BPE model, transformers writes its merges in score order, and these values are its scores.)"""
    scores: dict[str, float] = {}
    for merge in merges:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        scores.setdefault(left + right, -float(len(scores)))
    return scores


def _sentencepiece_json(tok, n_vocab: int, tj: dict) -> GGUFVocab:
    """The SentencePiece vocabulary of the tokenizer transformers runs (``tj``: its tokenizer.json, as transformers
    5 saves every SentencePiece tokenizer, with no tokenizer.model): pieces and ids from its model, scores from
    its merge order (Unigram: its own scores), byte and unknown pieces typed as SentencePiece types them. Where a
    tokenizer.model exists too this is still the one to follow: transformers ranks merges into runs of ▁ first,
    which SentencePiece's own scores (-1e9) put last."""
    model = tj["model"]
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [UNUSED] * n_vocab
    if model["type"] == "Unigram":
        pieces = {text: (tid, score) for tid, (text, score) in enumerate(model["vocab"])}
        unk = model.get("unk_id")
    else:
        merged = merge_scores(model.get("merges", []))
        floor = -float(len(merged))  # after every merge: pieces no merge makes are never made by llama.cpp either
        pieces = {text: (tid, merged.get(text, 0.0 if len(text) == 1 else floor))
                  for text, tid in model["vocab"].items()}
        unk = model["vocab"].get(model.get("unk_token") or "")
    for text, (tid, score) in pieces.items():
        if tid >= n_vocab:
            continue
        byte = re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text) is not None
        tokens[tid], scores[tid] = text, 0.0 if byte or tid == unk else score
        types[tid] = UNKNOWN if tid == unk else BYTE if byte else NORMAL
    prefix, inexact = space_prefix(tj, False)
    vocab = GGUFVocab("llama", "default", tokens, types, scores=scores, add_space_prefix=prefix, inexact=inexact)
    _common(tok, vocab, n_vocab)
    if model["type"] == "BPE":
        # Added tokens the merges also make (Gemma's runs of ▁, \n and \t): HF's BPE merges into them, so they keep
        # their merge score. Those holding ▁ are ordinary pieces, as llama.cpp turns ▁ back into a space only in
        # those; the others stay user-defined, which llama.cpp, like HF, matches in the text longest first.
        for tid, added in tok.added_tokens_decoder.items():
            if tid < n_vocab and not added.special and added.content in merged:
                vocab.scores[tid] = merged[added.content]
                if "▁" in added.content:
                    vocab.types[tid] = NORMAL
    return vocab


def _pre_steps(tj: dict) -> tuple[list[dict], tuple[tuple, ...]]:
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    key = tuple(("Split", s["pattern"].get("Regex", "")) if s.get("type") == "Split"
                else ("Digits", bool(s.get("individual_digits"))) if s.get("type") == "Digits"
                else (s.get("type"),) for s in steps if s.get("type") != "ByteLevel")
    return [s for s in steps if s.get("type") == "ByteLevel"], key


def bpe_pre_from_tokenizer_json(tj: dict) -> str | None:
    """Name llama.cpp gives this tokenizer's pre-tokenizer, or None when it cannot be identified."""
    byte_level, key = _pre_steps(tj)
    if not byte_level:
        return None
    if not key and not byte_level[0].get("use_regex", True):
        return None
    if tj.get("normalizer") not in (None, {}) and (tj.get("normalizer") or {}).get("type") != "NFC":
        return None
    return BPE_PRE_BY_STEPS.get(key)


def hf_pre_tokenizer(pre: str, byte_level: dict) -> dict | None:
    """The HF ``pre_tokenizer`` for llama.cpp's ``pre`` name (steps, then ``byte_level``), if known."""
    steps = BPE_PRE_STEPS.get(pre)
    if steps is None:
        return None
    hf = [{"type": "Split", "pattern": {"Regex": arg}, "behavior": "Isolated", "invert": False}
          if kind == "Split" else {"type": "Digits", "individual_digits": arg} for kind, arg in steps]
    return {"type": "Sequence", "pretokenizers": [*hf, byte_level]} if hf else byte_level


def _bytelevel_bpe(model_dir: Path, tok, n_vocab: int, bpe_pre: str | None, live: dict) -> GGUFVocab:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    # the pre-tokenizer transformers runs, which may not be the file's
    tj = {**tj, **{k: live[k] for k in ("normalizer", "pre_tokenizer") if k in live}}
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise UserError(f"tokenizer in {model_dir} is {model.get('type')}, not BPE or SentencePiece",
                        "tuneport writes SentencePiece and byte-level BPE vocabularies")
    pre = bpe_pre or bpe_pre_from_tokenizer_json(tj)
    if pre is None:
        raise UserError(f"cannot identify the BPE pre-tokenizer of {model_dir} for llama.cpp",
                        "pass --bpe-pre NAME with the llama.cpp name that matches it "
                        f"(e.g. {', '.join(KNOWN_BPE_PRE[:4])})")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [UNUSED] * n_vocab
    for text, tid in model["vocab"].items():
        if tid < n_vocab:
            tokens[tid], types[tid] = text, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab = GGUFVocab("gpt2", pre, tokens, types, merges=merges)
    _common(tok, vocab, n_vocab)
    return vocab


def _with_byte_pieces(vocab: GGUFVocab, shown: Path) -> GGUFVocab:
    """``vocab``, if it has the 256 byte pieces (``<0x00>`` .. ``<0xFF>``): llama.cpp's SentencePiece tokenizer
    falls back to them for any text its pieces do not cover, and aborts the process where one is missing."""
    have = {t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == BYTE}
    missing = [b for b in range(256) if f"<0x{b:02X}>" not in have]
    if missing:
        raise UserError(f"the SentencePiece tokenizer in {shown} has no byte piece for {len(missing)} of the 256 "
                        f"bytes (first <0x{missing[0]:02X}>): llama.cpp falls back to byte pieces for text outside "
                        "its vocabulary and aborts without them",
                        "export --target mlx or vllm, which run the HF tokenizer")
    return vocab


def read_vocab(model_dir: Path, n_vocab: int, bpe_pre: str | None = None, shown: Path | None = None) -> GGUFVocab:
    """The GGUF vocabulary of the tokenizer in ``model_dir``, padded to ``n_vocab`` (embedding rows);
    refusals name ``shown`` (the user's model directory when ``model_dir`` is a working copy)."""
    shown = shown or model_dir
    if not any((model_dir / n).exists() for n in ("tokenizer.model", "tokenizer.json")):
        raise UserError(f"{shown} has neither tokenizer.model nor tokenizer.json", "add the tokenizer files")
    tok = _hf_tokenizer(model_dir, shown)
    if len(tok) > n_vocab:
        raise UserError(f"the tokenizer has {len(tok)} tokens but the model only {n_vocab} embedding rows",
                        "pass the tokenizer that belongs to this model (after adding tokens, resize embeddings)")
    if (model_dir / "tokenizer.model").exists() and not bpe_pre:
        try:
            import sentencepiece as spm

            spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
        except (RuntimeError, OSError, ValueError) as e:  # sentencepiece: a corrupt or empty model file
            raise _unreadable(shown, e) from e
    live = effective_pipeline(tok, model_dir)
    if not bpe_pre and is_sentencepiece_json(live):
        # what transformers runs, whether it read tokenizer.json or converted tokenizer.model at load
        return _with_byte_pieces(_sentencepiece_json(tok, n_vocab, live), shown)
    if (model_dir / "tokenizer.model").exists() and not bpe_pre:
        return _with_byte_pieces(_sentencepiece(model_dir, tok, n_vocab, live), shown)
    if (model_dir / "tokenizer.json").exists():
        return _bytelevel_bpe(model_dir, tok, n_vocab, bpe_pre, live)
    raise UserError(f"--bpe-pre applies to a byte-level BPE tokenizer, and {shown} has no tokenizer.json",
                    "drop --bpe-pre (its tokenizer.model is SentencePiece)")
