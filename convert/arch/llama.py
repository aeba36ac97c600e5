"""Llama (1-3.x): the llama graph in llama.cpp, llama-family ("normal") RoPE."""

from ..calibration.layouts import transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import BIASES, COMMON, LLAMA_ROPE, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch
from .spec import LLAMA_LINEARS, ArchSpec

ARCH = ArchSpec(
    "llama",
    ("LlamaForCausalLM",),
    gguf_arch="llama",
    rope_style="normal",
    # vLLM's LlamaForCausalLM declares embedding_modules {embed_tokens, lm_head}.
    vllm_lora_modules=LLAMA_LINEARS + ("embed_tokens", "lm_head"),
    gguf=GGUFArch(COMMON_HPARAMS, {**COMMON, **NO_SLIDING_GRAPH, **BIASES, **LLAMA_ROPE},
                  write_vocab_size=True, write_rope_dims=True),
    mlx=MlxArch("llama"),
    awq=transformers_layout("llama", "Llama"),
    exl3=True,
)
