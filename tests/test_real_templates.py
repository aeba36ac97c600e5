"""The real chat templates of tests/real (Llama 3.2, Qwen2.5, Qwen3, Phi-4-mini, OLMo 2, Gemma 3), rendered three
ways for the same chats (without and with a system message, several turns, and with tools where the template
renders them): by transformers, by llama-cpp-python's formatter as ``tuneport serve`` renders a GGUF's template
(``convert/gguf/runtime.chat_renderer``), and, for one turn, by the Modelfile tuneport writes for Ollama. The text
must be the same (the tokens follow: llama.cpp's tokenizer is checked per family in test_real_tokenizers.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tuneport.convert.tokenizer_parity import CHATS, TOOL_CHAT, TOOLS

REAL = Path(__file__).parent / "real" / "bases"
TEMPLATES = {p.parent.name: p for p in sorted([*REAL.glob("*/tokenizer_config.json"),
                                                *REAL.glob("*/chat_template.json")])}
SPECIALS = {  # bos / eos text of each model (its tokenizer's)
    "meta-llama--Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen--Qwen2.5-7B-Instruct": ("", "<|im_end|>"), "Qwen--Qwen3-4B": ("", "<|im_end|>"),
    "microsoft--Phi-4-mini-instruct": ("<|endoftext|>", "<|endoftext|>"),
    "allenai--OLMo-2-1124-13B-Instruct": ("<|endoftext|>", "<|endoftext|>"),
    "google--gemma-3-4b-it": ("<bos>", "<eos>"),
}


def _template(name: str) -> str:
    data = json.loads(TEMPLATES[name].read_text())
    return data["chat_template"]


def _hf(template: str, messages: list[dict], tools: list[dict] | None, bos: str, eos: str) -> str | None:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        text, _ = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True,
                                        bos_token=bos, eos_token=eos)
    except Exception:  # noqa: BLE001 - a chat the template refuses (no system role): not compared
        return None
    return text[0]


def test_every_real_template_has_its_specials():
    assert set(TEMPLATES) == set(SPECIALS) and len(TEMPLATES) >= 6


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_real_template_renders_alike_in_transformers_llamacpp_and_ollama(name):
    pytest.importorskip("llama_cpp")
    from tests_helpers import render_ollama

    from tuneport.convert.gguf.modelfile import modelfile
    from tuneport.convert.gguf.runtime import chat_renderer

    template, (bos, eos) = _template(name), SPECIALS[name]
    render = chat_renderer(template, bos, eos)
    compared = 0
    cases = [(m, None) for m in CHATS] + ([(TOOL_CHAT, TOOLS)] if "tools" in template else [])
    for messages, tools in cases:
        want = _hf(template, messages, tools, bos, eos)
        if want is None:
            continue
        prompt, _ = render(messages, tools)
        # llama-cpp-python renders the BOS text as transformers does; the tokenizer adds it once either way
        assert prompt.removeprefix(bos) == want.removeprefix(bos), (name, messages)
        compared += 1
    assert compared >= 2 + ("tools" in template)
    text, warning = modelfile("m.gguf", template, eos=eos, bos=bos)
    go = re.search(r'TEMPLATE """(.*?)"""', text, re.S)
    assert warning is None and go is not None, text
    default = re.search(r'SYSTEM """(.*?)"""', text, re.S)
    for system in (None, "You are terse."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "Name a colour."}]
        want = _hf(template, messages, None, bos, eos)
        if want is not None:
            got = render_ollama(go[1], system or (default[1] if default else None), "Name a colour.")
            assert got == want.removeprefix(bos), (name, system, got, want)
