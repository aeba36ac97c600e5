"""What the real demo measures and asks: logits of chat prompts in the fp32 reference and in llama.cpp, and
one chat answer per model from a running gateway."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tuneport.convert.gguf.gpu import n_gpu_layers
from tuneport.serve.server import serve

from ..fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, load_peft, logits


def chat_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def chat_ids(base: Path, questions: tuple[str, ...]) -> list[torch.Tensor]:
    """Each question rendered by the base's chat template (with the generation prompt), as ``[1, T]`` ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    return [torch.tensor([tok.apply_chat_template(chat_messages(q), add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]]) for q in questions]


@functools.lru_cache(maxsize=4)
def _reference(base: Path, adapter: Path | None, ids: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    model = load_peft(base, adapter) if adapter else load_hf(base)
    return tuple(logits(model, torch.tensor([t]))[0] for t in ids)


def reference_logits(base: Path, adapter: Path | None, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 transformers (+ PEFT) logits ``[T, vocab]`` for each prompt (remembered for the process)."""
    return list(_reference(base, adapter, tuple(tuple(t[0].tolist()) for t in ids)))


def gguf_fidelity(base: Path, adapters: dict[str, Path], models: dict[str, Path], loras: dict[str, Path],
                  questions: tuple[str, ...], gpu_layers: int | str | None = None) -> list[dict]:
    """KL, top-1 and max |Δlogit| of every model file alone and with each GGUF LoRA, in llama.cpp."""
    ids = chat_ids(base, questions)
    rows = []
    for quant, model_file in models.items():
        for name, lora in [(None, None), *loras.items()]:
            ref = reference_logits(base, adapters[name] if name else None, ids)
            llm = llamacpp_model(model_file, lora, n_ctx=256, n_gpu_layers=n_gpu_layers(gpu_layers))
            try:
                got = [llamacpp_logits(llm, t[0].tolist()) for t in ids]
            finally:
                llm.close()
            cmp = compare_logits(torch.cat(ref), torch.cat(got))
            size = model_file.stat().st_size + (lora.stat().st_size if lora else 0)
            rows.append({"artifact": model_file.name + (f" + {lora.name}" if lora else ""), "quant": quant,
                         "adapter": name, "mb": size / 1e6, **cmp.as_dict()})
    return rows


def ask_each(model_file: Path, loras: dict[str, Path], questions: tuple[str, ...], *, kv_f32: bool = False,
             max_tokens: int = 40, gpu_layers: int | str | None = None) -> dict[str, dict[str, dict]]:
    """Serve ``model_file`` with ``loras`` (what ``tuneport serve`` runs) and ask every model every question,
    greedy: ``{model: {question: {text, token_ids, prompt_token_ids}}}`` (the base is ``"base"``)."""
    import httpx

    answers: dict[str, dict[str, dict]] = {}
    with serve(base=model_file, adapters=dict(loras), engine="llamacpp", max_adapters=4, n_ctx=512, contexts=2,
               kv_f32=kv_f32, gpu_layers=gpu_layers, port=0) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        names = {"base": server.backend.name, **{n: n for n in loras}}
        for label, model in names.items():
            answers[label] = {}
            for q in questions:
                r = client.post("/v1/chat/completions", json={
                    "model": model, "messages": chat_messages(q), "max_tokens": max_tokens, "temperature": 0,
                    "return_token_ids": True})
                r.raise_for_status()
                body = r.json()
                choice = body["choices"][0]
                answers[label][q] = {"text": choice["message"]["content"], "token_ids": choice["token_ids"],
                                     "prompt_token_ids": body["prompt_token_ids"]}
    return answers
