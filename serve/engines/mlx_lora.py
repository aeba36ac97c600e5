"""Many LoRA adapters over one MLX model at once, each batch row with its own adapter (stacked experts too:
:class:`MultiLoraSwitchGLU`).

An adapted module (a linear, or the token embedding) is wrapped once; its :class:`Stack` holds the
adapters that adapt it, stacked: ``a [n + 1, in, r]``, ``b [n + 1, r, out]`` with each adapter's scale
folded into ``b``, slot 0 all zeros (no adapter), ranks padded with zeros to the largest (which adds
exactly nothing). Before each forward the engine sets :class:`Rows` (each row's adapter); a wrapped
module then computes mlx-lm's own formulas per row ``i``::

    LoRA:  y = base(x) + (x @ a[i]) @ b[i]
    DoRA:  y = f[i] * (x Wᵀ + (x @ a[i]) @ b[i]) + bias,   f = m / ||W + b'ᵀ a'ᵀ||_row

``f`` is a constant vector per adapter and module, computed once when the adapter is placed (ones for
plain LoRA rows). Slots are local to a module and follow load order, so modules adapted by the same
adapters share one row-to-slot index per forward. Everything here runs on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

LINEARS = (nn.Linear, nn.QuantizedLinear)
EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)


@dataclass
class ModuleLora:
    """One adapter's LoRA for one module: ``a [in, r]``, ``b [r, out]`` (scale folded in), DoRA magnitude
    ``m [out]`` (``dora`` without ``m``: mlx-lm's initial magnitude, the base rows' norms)."""

    a: np.ndarray
    b: np.ndarray
    m: np.ndarray | None = None
    dora: bool = False

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes + (self.m.nbytes if self.m is not None else 0)


@dataclass(frozen=True)
class LoraTarget:
    """A module adapters may adapt: its kind and the shapes its LoRA matrices must have."""

    kind: str  # "linear", "embedding" or "switch" (a projection of stacked experts)
    n_in: int  # linear: input features; embedding: vocabulary
    n_out: int  # linear: output features; embedding: dimensions
    n_experts: int = 0  # switch: the experts stacked


def _dims(module: nn.Module) -> tuple[int, int]:
    """(rows, columns) of a (possibly quantized) weight: [out, in] for a linear, [vocab, dims] for an embedding."""
    rows, cols = module.weight.shape
    bits = getattr(module, "bits", None)
    return rows, (cols * 32 // bits if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) else cols)


def targets(model: nn.Module) -> dict[str, LoraTarget]:
    """Every linear and embedding of ``model`` by path (mlx parameter names without ``.weight``)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    out = {}
    for path, m in model.named_modules():
        base = m.base if isinstance(m, (MultiLoraLinear, MultiLoraEmbedding, MultiLoraSwitchGLU)) else m
        if isinstance(base, SwitchGLU):
            for name in MultiLoraSwitchGLU.PROJECTIONS:
                proj = base[name]
                n_experts, n_out, cols = proj.weight.shape
                bits = getattr(proj, "bits", None)
                n_in = cols * 32 // bits if "scales" in proj else cols
                out[f"{path}.{name}"] = LoraTarget("switch", n_in, n_out, n_experts)
            continue
        if isinstance(base, LINEARS):
            n_out, n_in = _dims(base)
            out[path] = LoraTarget("linear", n_in, n_out)
        elif isinstance(base, EMBEDDINGS):
            vocab, dims = _dims(base)
            out[path] = LoraTarget("embedding", vocab, dims)
    return {p: t for p, t in out.items() if not p.endswith(".base")}


def misfits(found: dict[str, LoraTarget], weights: dict[str, ModuleLora]) -> list[str]:
    """Why ``weights`` cannot go on a model with these targets (empty when they fit)."""
    problems = []
    for path, w in weights.items():
        t = found.get(path)
        if t is None:
            problems.append(f"{path}: the base has no such linear or embedding")
        elif t.kind == "switch":  # mlx-lm's LoRASwitchLinear: lora_a [E, r, in], lora_b [E, out, r]
            if w.dora or w.m is not None:
                problems.append(f"{path}: DoRA on stacked experts, which mlx-lm does not have")
            elif (w.a.ndim, w.b.ndim) != (3, 3) or w.a.shape[:1] != (t.n_experts,) or w.a.shape[2] != t.n_in \
                    or w.b.shape[:2] != (t.n_experts, t.n_out) or w.a.shape[1] != w.b.shape[2]:
                problems.append(f"{path}: lora_a {list(w.a.shape)} and lora_b {list(w.b.shape)} do not fit "
                                f"{t.n_experts} experts of {t.n_in} -> {t.n_out}")
        elif w.a.ndim != 2 or w.b.ndim != 2 or w.a.shape[1] != w.b.shape[0]:
            problems.append(f"{path}: lora_a {list(w.a.shape)} and lora_b {list(w.b.shape)} are not a LoRA pair")
        elif (w.a.shape[0], w.b.shape[1]) != (t.n_in, t.n_out):
            problems.append(f"{path}: LoRA for {w.a.shape[0]} -> {w.b.shape[1]}, the base's {t.kind} is "
                            f"{t.n_in} -> {t.n_out}")
        elif (w.dora or w.m is not None) and t.kind == "embedding":
            problems.append(f"{path}: DoRA on an embedding, which this engine does not serve")
        elif w.m is not None and w.m.shape != (t.n_out,):
            problems.append(f"{path}: DoRA magnitude of {list(w.m.shape)} for {t.n_out} outputs")
    return problems


class Rows:
    """The adapter of each row of the next forward (a load id; 0 = the base), shared by every wrapped module."""

    def __init__(self) -> None:
        self.ids: tuple[int, ...] = ()
        self._slots: dict[tuple[int, ...], int | mx.array | None] = {}

    def set(self, ids: Sequence[int]) -> None:
        self.ids = tuple(ids)
        self._slots = {}

    def slots(self, loaded: tuple[int, ...]) -> int | mx.array | None:
        """Each row's slot in a stack holding ``loaded`` (slot i + 1 = loaded[i]): None when no row uses
        them, an int when every row uses the same slot, else a [rows] index array. One per forward and stack."""
        if loaded not in self._slots:
            pos = {gid: i + 1 for i, gid in enumerate(loaded)}
            slots = [pos.get(gid, 0) for gid in self.ids]
            if all(s == slots[0] for s in slots):
                self._slots[loaded] = slots[0] or None
            else:
                self._slots[loaded] = mx.array(slots, dtype=mx.uint32)
        return self._slots[loaded]


@dataclass
class Stack:
    """The adapters of one module, stacked (see the module docstring); fp32, as mlx-lm keeps LoRA weights."""

    ids: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    doras: tuple[bool, ...] = ()
    a: mx.array | None = None
    b: mx.array | None = None
    f: mx.array | None = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.a, self.b, self.f) if x is not None)

    def add(self, gid: int, a: np.ndarray, b: np.ndarray, f: mx.array | None) -> None:
        """``a [..., in, r]``, ``b [..., r, out]`` (a leading expert axis for stacked experts)."""
        r = a.shape[-1]
        rank = max(r, *self.ranks) if self.ranks else r
        lead = [(0, 0)] * (a.ndim - 1)  # the slot axis and the leading axes
        new_a = mx.pad(mx.array(a, dtype=mx.float32)[None], [*lead, (0, 0), (0, rank - r)])
        new_b = mx.pad(mx.array(b, dtype=mx.float32)[None], [*lead, (0, rank - r), (0, 0)])
        if self.a is None:
            self.a = mx.concatenate([mx.zeros_like(new_a), new_a])
            self.b = mx.concatenate([mx.zeros_like(new_b), new_b])
        else:
            grow = rank - self.a.shape[-1]
            if grow:
                self.a = mx.pad(self.a, [*lead, (0, 0), (0, grow)])
                self.b = mx.pad(self.b, [*lead, (0, grow), (0, 0)])
            self.a = mx.concatenate([self.a, new_a])
            self.b = mx.concatenate([self.b, new_b])
        if f is not None or self.f is not None:
            old = self.f if self.f is not None else mx.ones((len(self.ids) + 1, b.shape[1]), mx.float32)
            self.f = mx.concatenate([old, (f if f is not None else mx.ones((b.shape[1],), mx.float32))[None]])
        self.ids, self.ranks, self.doras = (*self.ids, gid), (*self.ranks, r), (*self.doras, f is not None)
        mx.eval(*(x for x in (self.a, self.b, self.f) if x is not None))

    def remove(self, gid: int) -> None:
        i = self.ids.index(gid)
        keep = [j for j in range(len(self.ids)) if j != i]
        self.ids = tuple(self.ids[j] for j in keep)
        self.ranks = tuple(self.ranks[j] for j in keep)
        self.doras = tuple(self.doras[j] for j in keep)
        if not self.ids:
            self.a = self.b = self.f = None
            return
        rows = mx.array([0, *(j + 1 for j in keep)])
        rank = max(self.ranks)  # the padding the removed adapter needed goes too
        self.a, self.b = self.a[..., :rank][rows], self.b[..., :rank, :][rows]
        self.f = self.f[rows] if self.f is not None and any(self.doras) else None
        mx.eval(*(x for x in (self.a, self.b, self.f) if x is not None))


class MultiLoraLinear(nn.Module):
    """A linear (or quantized linear) with a stack of adapters, each row of a batch using its own."""

    def __init__(self, base: nn.Module, rows: Rows) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.stack = Stack()

    def base_weight(self) -> mx.array:
        """The base weight [out, in] in fp32 (dequantized): what the DoRA norm is taken of."""
        w = self.base.weight
        if isinstance(self.base, nn.QuantizedLinear):
            w = mx.dequantize(w, self.base.scales, getattr(self.base, "biases", None), group_size=self.base.group_size,
                              bits=self.base.bits, mode=self.base.mode)
        return w.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        st = self.stack
        if st.a is None or (slots := self.rows.slots(st.ids)) is None:
            return y
        z = (x @ st.a[slots]) @ st.b[slots]
        dora = {gid for gid, d in zip(st.ids, st.doras, strict=True) if d}
        row_dora = [gid in dora for gid in self.rows.ids]
        if st.f is None or not any(row_dora):  # rows without DoRA never see its rescaling (no bias round trip)
            return y + z.astype(y.dtype)
        f = st.f[slots] if isinstance(slots, int) else st.f[slots][:, None, :]
        bias = self.base.bias if "bias" in self.base else None
        out = f.astype(x.dtype) * ((y - bias if bias is not None else y) + z.astype(x.dtype))
        if bias is not None:
            out = out + bias
        if all(row_dora):
            return out
        return mx.where(mx.array(row_dora)[:, None, None], out, y + z.astype(y.dtype))


class MultiLoraEmbedding(nn.Module):
    """A (possibly quantized) embedding with a stack of adapters; ``as_linear`` (a tied output) too,
    as mlx-lm's LoRAEmbedding does."""

    def __init__(self, base: nn.Module, rows: Rows) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.stack = Stack()

    def __call__(self, tokens: mx.array) -> mx.array:
        y = self.base(tokens)
        st = self.stack
        if st.a is None or (slots := self.rows.slots(st.ids)) is None:
            return y
        if isinstance(slots, int):
            z = st.a[slots][tokens] @ st.b[slots]
        else:
            z = st.a[slots[:, None], tokens] @ st.b[slots]
        return y + z.astype(y.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        y = self.base.as_linear(x)
        st = self.stack
        if st.a is None or (slots := self.rows.slots(st.ids)) is None:
            return y
        z = (x @ st.b[slots].swapaxes(-1, -2)) @ st.a[slots].swapaxes(-1, -2)
        return y + z.astype(x.dtype)


class MultiLoraSwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU (a layer's stacked experts) with a stack of adapters per projection. Each stack is
    ``a [n + 1, E, in, r]``, ``b [n + 1, E, r, out]``; a token routed to expert ``e`` in a row using slot ``s``
    gets ``(x @ a[s, e]) @ b[s, e]``, gathered from the flattened stacks at ``s · E + e`` as mlx-lm's
    LoRASwitchLinear gathers ``e``. Tokens are not sorted by expert while adapters are live (sorting would
    lose each token's row)."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, base: nn.Module, rows: Rows) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.stacks = {p: Stack() for p in self.PROJECTIONS}

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        live = [(p, st, slots) for p, st in self.stacks.items()
                if st.a is not None and (slots := self.rows.slots(st.ids)) is not None]
        if not live:
            return self.base(x, indices)
        extra = {p: (st, slots) for p, st, slots in live}
        x = mx.expand_dims(x, (-2, -3))
        idx = mx.stop_gradient(indices)

        def project(name: str, h: mx.array) -> mx.array:
            y = self.base[name](h, idx)
            if name not in extra:
                return y
            st, slots = extra[name]
            n_experts = st.a.shape[1]
            rows = slots if isinstance(slots, int) else slots.reshape(-1, *([1] * (idx.ndim - 1)))
            at = rows * n_experts + idx
            z = mx.gather_mm(h, st.a.reshape(-1, *st.a.shape[2:]), rhs_indices=at)
            z = mx.gather_mm(z, st.b.reshape(-1, *st.b.shape[2:]), rhs_indices=at)
            return y + z.astype(y.dtype)

        up, gate = project("up_proj", x), project("gate_proj", x)
        return project("down_proj", self.base.activation(up, gate)).squeeze(-2)

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.stacks.values())


Wrapped = MultiLoraLinear | MultiLoraEmbedding


def _parent(model: nn.Module, path: str) -> tuple[object, str | int]:
    *head, last = path.split(".")
    node: object = model
    for part in head:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, int(last) if isinstance(node, list) else last


def _switch(model: nn.Module, path: str) -> tuple[str, str] | None:
    """(the SwitchGLU's path, the projection) when ``path`` is a projection of stacked experts."""
    from mlx_lm.models.switch_layers import SwitchGLU

    head, _, name = path.rpartition(".")
    if name not in MultiLoraSwitchGLU.PROJECTIONS:
        return None
    parent, key = _parent(model, head)
    return (head, name) if isinstance(parent[key], (SwitchGLU, MultiLoraSwitchGLU)) else None


def stack_of(model: nn.Module, path: str, rows: Rows) -> Stack:
    """The adapter stack of the module at ``path``, wrapping it (or its SwitchGLU) now if needed."""
    if (sw := _switch(model, path)) is not None:
        parent, key = _parent(model, sw[0])
        if not isinstance(parent[key], MultiLoraSwitchGLU):
            parent[key] = MultiLoraSwitchGLU(parent[key], rows)
        return parent[key].stacks[sw[1]]
    return wrapped(model, path, rows).stack


def wrapped(model: nn.Module, path: str, rows: Rows) -> Wrapped:
    """The module at ``path`` wrapped for adapters (wrapped now if it was not)."""
    parent, key = _parent(model, path)
    module = parent[key]
    if isinstance(module, (MultiLoraLinear, MultiLoraEmbedding)):
        return module
    wrapper = MultiLoraLinear(module, rows) if isinstance(module, LINEARS) else MultiLoraEmbedding(module, rows)
    parent[key] = wrapper
    return wrapper


def unwrap(model: nn.Module, path: str) -> None:
    """Put the base module back at ``path`` once no adapter adapts it."""
    parent, key = _parent(model, path)
    if isinstance(parent[key], (MultiLoraLinear, MultiLoraEmbedding)):
        parent[key] = parent[key].base


def place(model: nn.Module, rows: Rows, gid: int, weights: dict[str, ModuleLora]) -> None:
    """Add adapter ``gid`` to every module it adapts (DoRA factors computed here); all or nothing."""
    done = []
    try:
        for path, w in weights.items():
            if _switch(model, path) is not None:  # mlx-lm's [E, r, in] / [E, out, r] as [E, in, r] / [E, r, out]
                stack_of(model, path, rows).add(gid, np.swapaxes(w.a, -1, -2), np.swapaxes(w.b, -1, -2), None)
                done.append(path)
                continue
            module = wrapped(model, path, rows)
            f = None
            if w.dora or w.m is not None:
                weight = module.base_weight()
                m = mx.array(w.m, dtype=mx.float32) if w.m is not None else mx.linalg.norm(weight, axis=1)
                adapted = weight + mx.array(w.b, dtype=mx.float32).T @ mx.array(w.a, dtype=mx.float32).T
                f = m / mx.linalg.norm(adapted, axis=1)
            module.stack.add(gid, w.a, w.b, f)
            done.append(path)
    except BaseException:
        remove(model, gid, done)
        raise


def remove(model: nn.Module, gid: int, paths: Sequence[str]) -> None:
    """Take adapter ``gid`` out of the modules at ``paths``."""
    for path in paths:
        if (sw := _switch(model, path)) is not None:
            parent, key = _parent(model, sw[0])
            glu = parent[key]
            if isinstance(glu, MultiLoraSwitchGLU) and gid in glu.stacks[sw[1]].ids:
                glu.stacks[sw[1]].remove(gid)
                if not any(st.ids for st in glu.stacks.values()):
                    parent[key] = glu.base
            continue
        parent, key = _parent(model, path)
        module = parent[key]
        if isinstance(module, (MultiLoraLinear, MultiLoraEmbedding)) and gid in module.stack.ids:
            module.stack.remove(gid)
            if not module.stack.ids:
                unwrap(model, path)


def stack_bytes(model: nn.Module) -> int:
    """Bytes of every adapter stack in ``model`` (padding included)."""
    modules = [m for _, m in model.named_modules()]
    return (sum(m.stack.nbytes for m in modules if isinstance(m, (MultiLoraLinear, MultiLoraEmbedding)))
            + sum(m.nbytes for m in modules if isinstance(m, MultiLoraSwitchGLU)))
