"""The streaming calibration pass: token embeddings, then one decoder block at a time.

Each block is built from transformers' own decoder-layer class for the architecture, its weights read
(merged with any adapters) from disk, and run over every calibration sample; forward pre-hooks record,
for the input of each group of linears, the per-channel mean |x| and mean x² over all tokens (AWQ's
scale statistic and llama.cpp's importance matrix) and a fixed random subset of token rows (for the
searches). The block's outputs become the next block's inputs, in place. Only one block's weights and
the calibration activations are ever in memory.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arch import ExpertLayout
from ..fused_experts import fuse_to_memory
from ..merge import MergePlan, merge_one
from .layouts import AWQArch

FORWARD_TOKENS = 1024  # tokens per block forward (bounds the attention and MLP activations)
NOT_WEIGHTS = (".rotary_emb.inv_freq",)  # buffers some old checkpoints saved: recomputed by the layer
SEARCH_TOKENS = 2048  # token rows kept per group input for the scale and clip searches


@dataclass
class InputStats:
    """Running statistics of one linear group's input ``x [tokens, in]``."""

    sum_abs: torch.Tensor
    sum_sq: torch.Tensor
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.sum_abs / max(1, self.count)).float()

    @property
    def mean_sq(self) -> torch.Tensor:
        return (self.sum_sq / max(1, self.count)).float()

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0, self.sum_abs.numel())


@dataclass
class Block:
    """One decoder block after its calibration forward: the module (fp32, original weights) and the
    statistics of each hooked linear's input (keyed by module path inside the block)."""

    index: int
    prefix: str  # checkpoint name prefix, "model.layers.3."
    module: torch.nn.Module
    stats: dict[str, InputStats]
    config: Any = None  # the transformers config the block was built with
    experts: ExpertLayout | None = None  # where a mixture-of-experts block keeps its weights on disk


def _classes(arch: AWQArch):
    mod = importlib.import_module(arch.module)
    return getattr(mod, arch.layer_class), getattr(mod, arch.rotary_class), getattr(mod, arch.norm_class)


def hf_config(config: dict, attention: str | None = None):
    """The transformers config; ``attention``: the implementation the architecture's reference runs (sdpa
    when None)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("quantization_config",)})
    cfg._attn_implementation = attention or "sdpa"
    cfg._experts_implementation = "eager"  # a mixture's experts, one at a time (a layer alone is not dispatched)
    return cfg


class BlockPass:
    """Iterate over the blocks of ``plan``'s (merged) model with calibration ids ``[n, seqlen]``."""

    def __init__(self, plan: MergePlan, arch: AWQArch, ids: torch.Tensor, hooked: tuple[str, ...],
                 search_tokens: int = SEARCH_TOKENS, seed: int = 0) -> None:
        self.plan = plan
        self.arch = arch
        self.ids = ids
        self.hooked = hooked
        self.config = hf_config(plan.config, plan.base.arch.reference_attention if plan.base.arch else None)
        self.layer_cls, rotary_cls, self.norm_cls = _classes(arch)
        self.n_layers = int(self.config.num_hidden_layers)
        self.specs = {s.name: s for s in plan.specs}
        map_large_allocations()
        self.layer_prefix = plan.base.arch.layer_prefix if plan.base.arch else "model.layers"
        n, seq = ids.shape
        self.batch = max(1, FORWARD_TOKENS // seq)
        self.per_sample = max(1, -(-search_tokens // n))
        gen = torch.Generator().manual_seed(seed)
        self.rows = [torch.randperm(seq, generator=gen)[: self.per_sample].sort().values for _ in range(n)]
        with torch.no_grad():
            self.position_ids = torch.arange(seq).unsqueeze(0)
            self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.n_layers)
            self.position_embeddings, self.masks = self._positions_and_masks(rotary_cls, seq)

    def _positions_and_masks(self, rotary_cls, seq: int) -> tuple[dict, dict]:
        """Per layer type, the rotary embeddings and the attention mask the model's own forward gives its layers
        (transformers' mask functions: None where sdpa runs causally by itself, a sliding window's band, the
        explicit causal mask eager attention needs)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        rotary = rotary_cls(config=self.config)
        by_type = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma 3: one rope per type
        probe = torch.zeros(1, seq, int(self.config.hidden_size))
        kw = dict(config=self.config, inputs_embeds=probe, attention_mask=None, past_key_values=None,
                  position_ids=self.position_ids)
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        positions, masks = {}, {}
        for kind in dict.fromkeys(self.layer_types):
            positions[kind] = (rotary(probe, self.position_ids, kind) if by_type else
                               rotary(probe, self.position_ids))
            masks[kind] = makers.get(kind, create_causal_mask)(**kw)
        return positions, masks

    def tensor(self, name: str) -> torch.Tensor:
        return merge_one(self.plan, self.specs[name]).float()

    def embeddings(self) -> torch.Tensor:
        """The calibration tokens' rows, looked up in the stored dtype and then widened (not the whole table)."""
        name = f"{self.plan.base.arch.embed}.weight"
        x = torch.nn.functional.embedding(self.ids, merge_one(self.plan, self.specs[name])).float()
        return x if self.arch.embed_scale is None else x * self.arch.embed_scale(self.config)

    def load_block(self, i: int) -> torch.nn.Module:
        prefix = f"{self.layer_prefix}.{i}."
        with torch.device("meta"):
            layer = self.layer_cls(self.config, layer_idx=i)
        state = {n[len(prefix):]: self.tensor(n) for n in self.specs
                 if n.startswith(prefix) and not n.endswith(NOT_WEIGHTS)}
        state = fuse_to_memory(self.plan.base.arch, state)  # per-expert tensors as the layer holds them
        layer.load_state_dict(state, strict=True, assign=True)
        return layer.float().eval()

    def blocks(self, progress: Callable[[int, int], None] | None = None) -> Iterator[Block]:
        """Yield each block after its forward; ``self.hidden`` then holds its outputs (the next inputs)."""
        self.hidden = self.embeddings()
        for i in range(self.n_layers):
            block = Block(i, f"{self.layer_prefix}.{i}.", layer := self.load_block(i), self._forward(layer, i),
                          self.config, self.plan.base.arch.experts if self.plan.base.arch else None)
            del layer
            yield block
            del block  # the caller drops its reference too: one block in memory at a time
            release_freed_memory()
            if progress:
                progress(i + 1, self.n_layers)

    def final_norm_stats(self) -> InputStats:
        """Statistics of the lm_head's input (the final norm of the last block's output)."""
        norm = self.norm_cls(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.load_state_dict({"weight": self.tensor(f"{self.arch.final_norm}.weight")})
        stats = InputStats(torch.zeros(self.config.hidden_size, dtype=torch.float64),
                           torch.zeros(self.config.hidden_size, dtype=torch.float64))
        with torch.no_grad():
            for b in range(0, len(self.hidden), self.batch):
                x = norm(self.hidden[b:b + self.batch]).reshape(-1, self.config.hidden_size)
                _accumulate(stats, x)
        return stats

    def layer_inputs(self, i: int) -> dict:
        """The keyword arguments the model's forward gives layer ``i`` (besides its hidden states)."""
        kind = self.layer_types[i]
        return dict(attention_mask=self.masks[kind], position_ids=self.position_ids,
                    position_embeddings=self.position_embeddings[kind])

    def _forward(self, layer: torch.nn.Module, i: int) -> dict[str, InputStats]:
        stats: dict[str, InputStats] = {}
        current: list[int] = []
        handles = []

        def hook(name: str):
            def pre(_mod, args):
                x = args[0]
                if x.dim() == 2:  # inside a mixture-of-experts block (Qwen2-MoE's shared expert): tokens flattened
                    x = x.view(len(current), -1, x.shape[-1])
                st = stats.get(name)
                if st is None:
                    width = x.shape[-1]
                    st = stats[name] = InputStats(torch.zeros(width, dtype=torch.float64),
                                                  torch.zeros(width, dtype=torch.float64))
                _accumulate(st, x.reshape(-1, x.shape[-1]))
                for j, sample in enumerate(current):
                    st.rows.append(x[j, self.rows[sample]].detach().clone())
            return pre

        for name in self.hooked:
            handles.append(layer.get_submodule(name).register_forward_pre_hook(hook(name)))
        if self.arch.moe_norm is not None:
            experts = layer.get_submodule(f"{self.plan.base.arch.experts.memory_block}.experts")
            handles.append(experts.register_forward_pre_hook(self._expert_hook(stats)))
        try:
            with torch.no_grad():
                for b in range(0, len(self.hidden), self.batch):
                    current[:] = range(b, min(b + self.batch, len(self.hidden)))
                    out = layer(self.hidden[b:b + self.batch], **self.layer_inputs(i))
                    self.hidden[b:b + self.batch] = out[0] if isinstance(out, tuple) else out
                    del out
        finally:
            for h in handles:
                h.remove()
        return stats


    def _expert_hook(self, stats: dict[str, InputStats]):
        """Statistics of a mixture-of-experts block: ``experts`` (every token, the input the router and all the
        experts' gate/up share), ``experts.{e}`` (the tokens the router sends expert ``e``) and ``experts.{e}.down``
        (expert ``e``'s down_proj input, act(gate) * up, from the block's current weights)."""
        cap = max(1, self.per_sample * len(self.ids))  # rows kept per expert for the searches

        def add(name: str, x: torch.Tensor, keep: bool) -> None:
            st = stats.get(name)
            if st is None:
                st = stats[name] = InputStats(torch.zeros(x.shape[-1], dtype=torch.float64),
                                              torch.zeros(x.shape[-1], dtype=torch.float64))
            _accumulate(st, x)
            if keep and (room := cap - sum(len(r) for r in st.rows)) > 0:
                st.rows.append(x[:room].detach().clone())

        def pre(mod, args):
            x, top_k_index = args[0], args[1]
            add("experts", x, keep=False)
            inter = mod.gate_up_proj.shape[1] // 2
            for e in range(mod.gate_up_proj.shape[0]):
                xe = x[(top_k_index == e).any(-1)]
                if not len(xe):
                    continue
                gate, up = torch.nn.functional.linear(xe, mod.gate_up_proj[e]).split(inter, dim=-1)
                add(f"experts.{e}", xe, keep=True)
                add(f"experts.{e}.down", mod.act_fn(gate) * up, keep=True)
        return pre


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def map_large_allocations(threshold: int = 4 << 20) -> None:
    """Allocations above ``threshold`` get their own mappings, returned to the OS when freed. glibc's default
    threshold grows up to 32 MiB after the first large frees, so a block's activations (tens of MiB each)
    would stay resident after each forward and the peak would grow with fragmentation, not with real use."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS between blocks (glibc keeps them otherwise, and the resident size
    creeps up block after block)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _accumulate(st: InputStats, x: torch.Tensor) -> None:
    x64 = x.double()
    st.sum_abs += x64.abs().sum(0)
    st.sum_sq += x64.pow(2).sum(0)
    st.count += x.shape[0]
