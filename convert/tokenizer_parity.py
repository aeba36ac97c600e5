"""What breaks deployments although the weights are right: the tokenizer, the chat template and the
special token ids of an artifact, compared with the reference's HF tokenizer (``tuneport verify`` runs these on
every artifact; ``export --target gguf`` on the file it writes)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Strings whose tokens differ between pre-tokenizers, normalizers and special-token handling.
TOKENIZER_BATTERY: tuple[str, ...] = (
    "Hello world", "  two leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\n\n\nthree",
    "12345 67890 3.14159 1,000,000", "naïve café déjà vu", "日本語のテキストと中文", "emoji 🎉🚀 and 👩‍💻 (ZWJ)",
    "def f(x):\n    return x ** 2  # square\n", "<|im_start|>user\nhi<|im_end|>\n", "     ", "a\u00a0b\u2009c",
    "Ünïcödé ÅÄÖ ß", 'x = [1, 2, 3]; y = {"k": "v"}', "it's don't they're we'll I'd you've", "HTTP/1.1 200 OK\r\n",
    "\tindented\n\t\tmore", "C++ and C# and F#", "<|endoftext|>text after", "hello  world   !!   ?",
    "Ⅻ ½ ² ∑ ∫ → ≤", "مرحبا بالعالم", "नमस्ते दुनिया", "https://example.com/a?b=c&d=e#f", "**bold** _it_ `code`",
    "SELECT * FROM t WHERE id = 42;", "'''quoted''' \"\"\"doc\"\"\"", "\n", "a" * 50, "Zürich 2024-11-30T15:40:00Z",
    "IT'S LOUD AND IT'LL STAY", "x\n\n\n\ny \r\n\r\n z", "1234567890123",
)
# Chats for the template check: no system message, a system message, several turns with unicode.
CHATS: tuple[list[dict], ...] = (
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write `print(1)` in Python 🐍\n\twith a tab."}],
)


# A chat with tools, for templates that render them (Qwen 2.5/3, Llama 3.1+, Mistral, SmolLM3, ...).
TOOLS: list[dict] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]
TOOL_CHAT: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass
class Check:
    """One parity check: passed (None: not applicable), what was compared, the first difference."""

    name: str
    passed: bool | None
    detail: str = ""
    counts: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "detail": self.detail, **self.counts}


def _hf_ids(tok, text: str) -> list[int]:
    return tok(text).input_ids


def different_strings(tokenize, tok) -> list[str]:
    """The battery's strings ``tokenize(text) -> ids`` tokenizes differently from ``tok``."""
    return [s for s in TOKENIZER_BATTERY if tokenize(s) != _hf_ids(tok, s)]


def tokenizer_parity(tokenize, tok) -> Check:
    """``tokenize(text) -> ids`` (the artifact's tokenizer, special tokens parsed) against ``tok``."""
    bad = different_strings(tokenize, tok)
    detail = (f"{len(TOKENIZER_BATTERY)}/{len(TOKENIZER_BATTERY)} strings give the same tokens" if not bad else
              f"{len(bad)}/{len(TOKENIZER_BATTERY)} strings tokenize differently, first {bad[0]!r}: "
              f"artifact {tokenize(bad[0])[:12]} vs reference {_hf_ids(tok, bad[0])[:12]}")
    return Check("tokenizer", not bad, detail, {"strings": len(TOKENIZER_BATTERY), "different": len(bad)})


def _chat_cases(tok) -> list[tuple[list[dict], list[dict] | None]]:
    cases: list[tuple[list[dict], list[dict] | None]] = [(m, None) for m in CHATS]
    if "tools" in (tok.chat_template or ""):
        cases.append((TOOL_CHAT, TOOLS))
    return cases


def detokenizer_parity(detokenize, tok) -> Check:
    """``detokenize(ids) -> text`` (the artifact's) against HF's decode of the same ids (no clean-up, special
    tokens kept), for the battery's strings as HF tokenizes them."""
    bad = []
    for s in TOKENIZER_BATTERY:
        ids = tok(s, add_special_tokens=False).input_ids
        if detokenize(ids) != tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
            bad.append(s)
    detail = (f"{len(TOKENIZER_BATTERY)}/{len(TOKENIZER_BATTERY)} strings decode to the same text" if not bad else
              f"{len(bad)}/{len(TOKENIZER_BATTERY)} strings decode differently, first {bad[0]!r}")
    return Check("detokenizer", not bad, detail, {"strings": len(TOKENIZER_BATTERY), "different": len(bad)})


def chat_template_parity(render, tok) -> Check:
    """``render(messages, tools=None) -> ids`` (the artifact's own template, None when it has none) against
    ``tok.apply_chat_template``: chats without and with a system message, several turns, and a chat with tools
    where the template renders them."""
    if not tok.chat_template:
        return Check("chat_template", None, "the reference has no chat template")
    compared = 0
    for messages, tools in _chat_cases(tok):
        what = f"a {len(messages)}-message chat" + (" with tools" if tools else "")
        try:
            want = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)
        except Exception:  # the reference's template refuses this chat (e.g. no system role): not compared
            continue
        want = list(want["input_ids"])
        try:
            got = render(messages, tools=tools) if tools else render(messages)
        except Exception as e:
            return Check("chat_template", False, f"the artifact's chat template fails on {what} that the reference "
                         f"renders ({type(e).__name__}: {str(e)[:80]})")
        if got is None:
            return Check("chat_template", False, "the artifact has no chat template; the reference has one")
        compared += 1
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            return Check("chat_template", False, f"{what} renders differently from token "
                         f"{at}: artifact {tok.decode(got[at:at + 8])!r} vs reference {tok.decode(want[at:at + 8])!r}")
    return Check("chat_template", True, f"{compared} chats render the same tokens")


def special_tokens_parity(artifact: dict[str, int | bool | None], tok) -> Check:
    """The artifact's bos/eos ids and add_bos/add_eos against what the HF tokenizer does."""
    probe = tok("a").input_ids
    ref = {"bos": tok.bos_token_id, "eos": tok.eos_token_id,
           "add_bos": bool(probe) and tok.bos_token_id is not None and probe[0] == tok.bos_token_id,
           "add_eos": bool(probe) and tok.eos_token_id is not None and probe[-1] == tok.eos_token_id}
    diff = [f"{k}: artifact {artifact.get(k)!r} vs reference {v!r}" for k, v in ref.items()
            if v is not None and artifact.get(k) != v]
    return Check("special_tokens", not diff, "; ".join(diff) or "bos/eos ids and add_bos/add_eos agree")


def special_token_types(types: list[int], parse, tok) -> Check:
    """Every token HF adds on top of its model (``added_tokens_decoder``): the artifact's token type (llama.cpp's:
    3 control for special ones, 4 user-defined or 1 normal for the others) and ``parse(content)`` (special tokens
    parsed, nothing added) giving that one token, as HF parses it (a special token written as a normal one would
    split into pieces)."""
    normal, control, user_defined = 1, 3, 4
    wrong = []
    for tid, added in sorted(tok.added_tokens_decoder.items()):
        if tid >= len(types):
            continue
        # a non-special added token the model's merges make anyway may be an ordinary piece (normal)
        want = (control,) if added.special else (user_defined, normal)
        if types[tid] not in want:
            wrong.append(f"{added.content!r} ({tid}) is type {types[tid]}, HF treats it as "
                         f"{'control' if added.special else 'user-defined'}")
        elif (got := parse(added.content)) != [tid]:
            wrong.append(f"{added.content!r} ({tid}) tokenizes to {got[:4]}, HF to [{tid}]")
    n = len([t for t in tok.added_tokens_decoder if t < len(types)])
    return Check("special_token_types", not wrong, f"{len(wrong)}/{n} added tokens differ, first: {wrong[0]}" if wrong
                 else f"{n} added tokens: types and parsing as HF", {"added_tokens": n, "different": len(wrong)})
