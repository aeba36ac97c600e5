"""Compare an artifact's numbers with the fp32 transformers/PEFT reference.

Metrics: max |Δlogit|, KL(ref‖art), top-1 agreement, and greedy tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class LogitComparison:
    max_abs: float
    kl: float
    top1: float

    def as_dict(self) -> dict:
        return asdict(self)


def compare_logits(ref: torch.Tensor, art: torch.Tensor) -> LogitComparison:
    """``ref`` and ``art`` are ``[..., vocab]`` logits of the same tokens."""
    ref, art = ref.double(), art.double()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(art, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == art.argmax(-1)).double().mean().item()
    return LogitComparison((ref - art).abs().max().item(), kl, top1)


def load_hf(path: Path | str, dtype: torch.dtype = torch.float32, vocab: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tuneport.convert.arch import known_arch

    spec = known_arch(AutoConfig.from_pretrained(path).model_type)
    # the reference's own kernel, whatever the config names (a fine-tune saved with flash_attention_2 loads on CPU)
    attention = spec.reference_attention if spec and spec.reference_attention else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
    model = model.to(dtype)  # gpt-oss's MXFP4 experts load dequantized to bfloat16 whatever dtype asks
    if vocab is not None and model.get_input_embeddings().weight.shape[0] != vocab:
        model.resize_token_embeddings(vocab, mean_resizing=False)
    return model.eval()


def adapter_vocab(adapter: Path | str) -> int | None:
    """The vocabulary the adapter was trained with, when it saved a resized embedding."""
    from safetensors import safe_open

    f = Path(adapter) / "adapter_model.safetensors"
    with safe_open(str(f), "pt") as st:
        for k in st.keys():
            if k.endswith(("embed_tokens.modules_to_save.weight", "embed_tokens.base_layer.weight",
                           "embed_tokens.weight")) and ".lora_" not in k:
                return st.get_slice(k).get_shape()[0]
    return None


def load_peft(base: Path | str, adapter: Path | str, dtype: torch.dtype = torch.float32):
    """The reference: transformers base + PEFT adapter, unmerged, in ``dtype``."""
    from peft import PeftModel

    model = load_hf(base, dtype, adapter_vocab(adapter))
    return PeftModel.from_pretrained(model, str(adapter)).eval()


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, never stopping at EOS (engines are asked for ``ignore_eos``)."""
    seq = torch.tensor([ids])
    out: list[int] = []
    past = None
    step = seq
    for _ in range(n):
        res = model(step, past_key_values=past, use_cache=True)
        past = res.past_key_values
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
        step = torch.tensor([[tok]])
    return out


def llamacpp_greedy(path: Path | str, lora: Path | str | None, prompt: list[int], n: int,
                    n_ctx: int = 128) -> list[int]:
    """``n`` greedy tokens for ``prompt`` from a fresh llama.cpp holding only ``lora`` (or no adapter): the
    reference a served answer is held to."""
    llm = llamacpp_model(path, lora, n_ctx=n_ctx)
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


def llamacpp_model(path: Path | str, lora: Path | str | None = None, n_ctx: int = 128, n_gpu_layers: int = 0):
    """llama.cpp (llama-cpp-python) set up for parity runs: F32 KV cache, flash attention off, logits for every
    position; ``n_gpu_layers`` as llama.cpp takes it (-1: all, see convert.gguf.gpu); as many threads as ``tuneport
    serve`` gives llama.cpp (the physical cores this process may use; it was 2 whatever the machine). Close it with
    ``.close()``."""
    import llama_cpp

    from tuneport.convert.gguf.runtime import llamacpp_logging
    from tuneport.serve.engines.llamacpp_state import physical_cores

    with llamacpp_logging():
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                               type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
                               n_gpu_layers=n_gpu_layers, lora_path=str(lora) if lora else None, verbose=False,
                               n_threads=physical_cores())


def llamacpp_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    import numpy as np

    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
