"""llama.cpp importance matrices from tuneport's streaming calibration pass.

An importance matrix holds, for every weight that llama.cpp quantizes, the sum of x² over the calibration
tokens for each input column of that weight, and the token count; llama.cpp's quantizer weighs each
column's rounding error by the mean (sum / count). tuneport computes it with the AWQ calibration pass
(``convert.calibration.blocks.BlockPass``: transformers' own decoder layers, one block in memory at a time), names
it with the GGUF exporter's own tensor names, and writes llama.cpp's GGUF imatrix file (as
``llama-imatrix`` does: ``general.type = imatrix``, ``imatrix.datasets``, ``imatrix.chunk_count``,
``imatrix.chunk_size``, and per tensor ``<name>.in_sum2`` F32 [n_cols, n_mat] and ``<name>.counts`` F32
[1, n_mat]), which ``llama-quantize --imatrix`` reads. n_mat is 1 for a dense weight; a mixture of experts'
stacked ``ffn_{gate,up,down}_exps`` keep one row per expert, summed over the tokens the router sent it (an
expert no token reached has count 0, which llama.cpp's quantizer reads as all-ones weights); its router
``ffn_gate_inp`` sees every token. The q/k row permutation of llama-family GGUFs reorders rows only, so
per-input-column values need no change.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..arch import ArchSpec
from ..errors import UserError
from ..merge import MergePlan

log = logging.getLogger(__name__)

KV_DATASETS = "imatrix.datasets"
KV_CHUNK_COUNT = "imatrix.chunk_count"
KV_CHUNK_SIZE = "imatrix.chunk_size"
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"
OUTPUT = "output.weight"


@dataclass
class IMatrix:
    """Per GGUF tensor name: Σx² per input column (float64) and the number of tokens summed; for a stacked
    expert tensor, one row of sums [n_experts, n_cols] and a tuple of counts, one per expert."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int | tuple[int, ...]] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def add(self, name: str, sum_sq: np.ndarray, count: int) -> None:
        self.sums[name] = np.asarray(sum_sq, dtype=np.float64).copy()
        self.counts[name] = int(count)

    def add_stacked(self, name: str, sums: np.ndarray, counts) -> None:
        """A stacked expert tensor: ``sums`` [n_experts, n_cols], ``counts`` one per expert."""
        self.sums[name] = np.asarray(sums, dtype=np.float64).reshape(len(counts), -1).copy()
        self.counts[name] = tuple(int(c) for c in counts)

    def rows(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Sums [n_mat, n_cols] and counts [n_mat], whichever kind ``name`` is."""
        counts = np.atleast_1d(np.asarray(self.counts[name], dtype=np.float64))
        return self.sums[name].reshape(len(counts), -1), counts

    def mean(self, name: str) -> np.ndarray:
        """What llama.cpp's quantizer weighs columns by: Σx² / count per matrix (1 where no token reached an
        expert), flattened, float32."""
        sums, counts = self.rows(name)
        means = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], 1.0)
        return means.reshape(-1).astype(np.float32)

    @property
    def names(self) -> list[str]:
        return sorted(self.sums)

    def describe(self) -> dict:
        return {"tensors": len(self.sums), "chunks": self.chunk_count, "chunk_size": self.chunk_size,
                "datasets": list(self.datasets), "output_weight": OUTPUT in self.sums}


def gguf_names(arch: ArchSpec, plan: MergePlan) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, from the exporter's own plan."""
    from .model import plan_gguf_model

    shapes = [(s.name, s.shape) for s in plan.specs]
    return {t.hf_name: t.gguf_name for t in plan_gguf_model(arch, plan.config, shapes, "F32").tensors if t.hf_name}


def gguf_stacks(arch: ArchSpec, plan: MergePlan) -> dict[str, tuple[str, int]]:
    """A per-expert HF tensor -> (the stacked GGUF tensor holding it, its expert index)."""
    from .model import plan_gguf_model

    shapes = [(s.name, s.shape) for s in plan.specs]
    return {hf: (t.gguf_name, e) for t in plan_gguf_model(arch, plan.config, shapes, "F32").tensors
            for e, hf in enumerate(t.stack)}


def calibration_arch(model_type: str, config: dict | None = None):
    """The calibration pass's table entry (transformers layer classes, linears sharing an input)."""
    from ..arch import target_refusal
    from ..calibration.archs import AWQ_ARCHS, dense_layers_refusal

    if (why := target_refusal(model_type, "awq")) is None:
        carch = AWQ_ARCHS[model_type]
        if (why := dense_layers_refusal(carch, config or {})) is None:
            return carch
    raise UserError(f"--calib (importance matrix) is not available for this {model_type!r}: {why}",
                    f"drop --calib/--calib-samples/--calib-seqlen and use a --quant type that needs no "
                    f"importance matrix (k-quants, iq3_s, iq4_xs, ...); tuneport's importance matrix covers "
                    f"{', '.join(sorted(AWQ_ARCHS))}")


def compute_imatrix(plan: MergePlan, arch: ArchSpec, ids, *, dataset: str = "", process_output: bool = True,
                    progress=None) -> IMatrix:
    """Run the calibration ids ``[n, seqlen]`` through ``plan``'s (merged) model block by block and return the
    importance matrix of every block linear, plus ``output.weight`` (from the final norm's output) when
    ``process_output`` and the GGUF has its own output tensor (with tied embeddings llama.cpp reuses
    ``token_embd.weight``, for which ``llama-imatrix`` records nothing either)."""
    from ..calibration.blocks import BlockPass
    from ..calibration.hooks import hooked_modules

    carch = calibration_arch(arch.model_type, plan.config)
    names = gguf_names(arch, plan)
    im = IMatrix(datasets=[dataset] if dataset else [], chunk_count=int(ids.shape[0]),
                 chunk_size=int(ids.shape[1]))
    bp = BlockPass(plan, carch, ids, hooked_modules(carch), search_tokens=0)
    stacks = gguf_stacks(arch, plan) if arch.experts is not None else {}
    for block in bp.blocks(progress):
        for group in carch.groups:
            stats = block.stats[group.linears[0]]
            for linear in group.linears:
                hf = f"{block.prefix}{linear}.weight"
                if hf not in names:
                    raise RuntimeError(f"{hf} has no GGUF tensor")
                im.add(names[hf], stats.sum_sq.numpy(), stats.count)
        if arch.experts is not None:
            _add_experts(im, block, names, stacks)
        log.debug("imatrix: block %d done", block.index)
    outputs = [hf for hf, g in names.items() if g == OUTPUT]
    if process_output and outputs:
        stats = bp.final_norm_stats()
        im.add(OUTPUT, stats.sum_sq.numpy(), stats.count)
    return im


def _add_experts(im: IMatrix, block, names: dict[str, str], stacks: dict[str, tuple[str, int]]) -> None:
    """A mixture-of-experts block: the router over every token, each stacked projection one row per expert
    over the tokens routed to it (its down_proj over act(gate) * up), as llama-imatrix records MUL_MAT_ID."""
    from ..calibration.hooks import expert_modules

    layout = block.experts
    every = block.stats["experts"]
    router = f"{block.prefix}{layout.disk_block}.{layout.router}.weight"
    if router not in names:
        raise RuntimeError(f"{router} has no GGUF tensor")
    im.add(names[router], every.sum_sq.numpy(), every.count)
    stacked: dict[str, dict[int, object]] = {}
    for (e, proj), module in expert_modules(block).items():
        gguf_name, index = stacks[f"{module}.weight"]
        stacked.setdefault(gguf_name, {})[index] = block.stats.get(
            f"experts.{e}.down" if proj == layout.down else f"experts.{e}")  # None: no token reached it
    for gguf_name, by_expert in stacked.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        n_cols = next(st.sum_sq.numel() for st in order if st is not None)  # the router always picks some
        im.add_stacked(gguf_name, np.stack([st.sum_sq.numpy() if st is not None else np.zeros(n_cols)
                                            for st in order]),
                       [st.count if st is not None else 0 for st in order])


def write_imatrix(im: IMatrix, path: Path, arch: str = "llama") -> None:
    """llama.cpp's GGUF imatrix file (what ``llama-imatrix -o FILE.gguf`` writes), tensors in name order."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type("imatrix")
    writer.add_array(KV_DATASETS, list(im.datasets))
    writer.add_uint32(KV_CHUNK_COUNT, im.chunk_count)
    writer.add_uint32(KV_CHUNK_SIZE, im.chunk_size)
    for name in im.names:
        sums, counts = im.rows(name)  # ne = [n_cols, n_mat] and [1, n_mat], as llama-imatrix writes
        writer.add_tensor(name + SUM_SUFFIX, sums.astype(np.float32))
        writer.add_tensor(name + COUNT_SUFFIX, counts.astype(np.float32).reshape(-1, 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _field(reader, key: str):
    f = reader.fields.get(key)
    return f.contents() if f is not None else None


def read_imatrix(path: Path) -> IMatrix:
    """A GGUF imatrix file (tuneport's or ``llama-imatrix``'s): sums and counts per tensor."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise UserError(f"{path} is not a GGUF imatrix file ({e})", "pass a file written by llama-imatrix") from None
    im = IMatrix(datasets=list(_field(reader, KV_DATASETS) or []), chunk_count=int(_field(reader, KV_CHUNK_COUNT) or 0),
                 chunk_size=int(_field(reader, KV_CHUNK_SIZE) or 0))
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(SUM_SUFFIX):
            sums[t.name.removesuffix(SUM_SUFFIX)] = np.asarray(t.data, dtype=np.float64).reshape(-1)
        elif t.name.endswith(COUNT_SUFFIX):
            counts[t.name.removesuffix(COUNT_SUFFIX)] = np.asarray(t.data).reshape(-1)
    if set(sums) != set(counts):
        raise UserError(f"{path}: mismatched sums and counts for {sorted(set(sums) ^ set(counts))[:3]}",
                        "pass a file written by llama-imatrix")
    for name, c in counts.items():
        if c.size == 1:
            im.add(name, sums[name], int(round(float(c[0]))))
        else:  # a stacked expert tensor: one row per expert
            im.add_stacked(name, sums[name], [int(round(float(x))) for x in c])
    return im


@dataclass
class LlamaCppIMatrix:
    """``llama_model_imatrix_data[]`` for ``llama_model_quantize_params.imatrix``, ``{NULL, NULL, 0}``
    terminated; holds the float arrays the pointers refer to, so keep it alive during the call."""

    array: ctypes.Array
    buffers: list[np.ndarray]
    names: list[bytes]

    def pointer(self):
        import llama_cpp

        return ctypes.cast(self.array, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))


def llamacpp_imatrix(im: IMatrix) -> LlamaCppIMatrix:
    import llama_cpp

    names = im.names
    array = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()  # zero-filled: the last is the terminator
    buffers, keys = [], []
    for i, name in enumerate(names):
        data = np.ascontiguousarray(im.mean(name), dtype=np.float32)
        key = name.encode()
        buffers.append(data)
        keys.append(key)
        array[i].name = key
        array[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        array[i].size = data.size
    return LlamaCppIMatrix(array, buffers, keys)
