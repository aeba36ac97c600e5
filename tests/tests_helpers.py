"""Helpers shared by engine tests."""

from __future__ import annotations

from toolkit.fidelity import llamacpp_model


def fresh_greedy(model, lora, prompt, n):
    """``n`` greedy tokens from a fresh llama.cpp instance holding only ``lora`` (or no adapter)."""
    llm = llamacpp_model(model, lora)
    try:
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in range(n):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            out.append(tok)
            llm.eval([tok])
        return out
    finally:
        llm.close()
