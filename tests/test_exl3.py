"""EXL3 without CUDA: tuneport's decoder (codebooks, trellis bit layout, tail-biting, Hadamard rotations) checked
against scalar emulations of exllamav3's kernels and a reference encoder written here; the EXL3 reader,
``inspect`` and the export's decode check on an EXL3 directory laid out as exllamav3 writes it; and
``export --target exl3`` failing fast without CUDA, its ``--dry-run`` plan and its option checks.

The GPU check (exllamav3's own converter, then tuneport's decoder on its output) needs a CUDA host: see
docs/exl3.md."""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import listdir
from safetensors import safe_open
from safetensors.torch import save_file

from tuneport.convert.errors import FidelityError, UserError
from tuneport.convert.exl3 import trellis as T
from tuneport.convert.exl3.codebook import CODEBOOKS, MULTIPLIERS, lookup_table, marker_problem
from tuneport.convert.exl3.export import MISMATCH, decode_check, expected_error
from tuneport.convert.exl3.hadamard import BLOCK, hadamard_128, reconstruct, regularize
from tuneport.convert.exl3.read import Exl3Model, expert_reference
from tuneport.convert.support_matrix import supported

KS = [2, 3, 4]


# -- scalar emulations of exllamav3's kernels (one weight, one bit at a time) --------------------------------
def scalar_codebook(state: int, codebook: str) -> float:
    """codebook.cuh, one state: uint32 arithmetic, then the fp16 operations."""
    if codebook == "mul1":
        x = (state * 0x83DCD12D) & 0xFFFFFFFF
        h = np.float16(1024 + sum((x >> (8 * i)) & 0xFF for i in range(4)))
        return float(np.float16(np.float32(h) * np.float32(np.float16(0.00676727294921875))
                                + np.float32(np.float16(-10.3828125))))
    x = (state * (89226354 if codebook == "3inst" else 0xCBAC1FED) + (64248484 if codebook == "3inst" else 0))
    x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60
    lo, hi = (np.frombuffer(struct.pack("<H", v), np.float16)[0] for v in (x & 0xFFFF, x >> 16))
    return float(np.float16(lo + hi))


def scalar_pack(states: list[int], k: int) -> list[int]:
    """pack.cu: symbols shifted into a 32-bit buffer MSB first, 16-bit words out, halves of each pair swapped."""
    words, buf, room = [], 0, 32
    for s in states:
        room -= k
        buf |= (s & ((1 << k) - 1)) << room
        if room <= 16:
            words.append((buf >> 16) & 0xFFFF)
            buf, room = (buf << 16) & 0xFFFFFFFF, room + 16
    swapped = [w for i in range(0, len(words), 2) for w in (words[i + 1], words[i])]
    return [w - 0x10000 if w >= 0x8000 else w for w in swapped]


def scalar_pack_frac(states: list[int], k: float) -> list[int]:
    """frac.cu's pack kernel: position i adds D(i) = KA + bit (i mod 16) of 0xAAAA, MSB first into 32-bit words,
    stored as they are (little-endian: each word is two int16 values, low half first)."""
    ka, bits = int(k), []
    for i, s in enumerate(states):
        d = ka + ((0xAAAA >> (i % 16)) & 1)
        bits += [(s >> b) & 1 for b in range(d - 1, -1, -1)]
    out = []
    for w in range(len(bits) // 32):
        word = sum(bit << (31 - j) for j, bit in enumerate(bits[32 * w: 32 * w + 32]))
        out += [word & 0xFFFF, word >> 16]
    return [v - 0x10000 if v >= 0x8000 else v for v in out]


def scalar_unpack_frac(words16: list[int], k: float) -> list[int]:
    """frac.cu's unpack: position i's state is the 16-bit window of the ring ending at S(i) = Σ D(0..i)."""
    words = [(words16[2 * w] & 0xFFFF) | ((words16[2 * w + 1] & 0xFFFF) << 16) for w in range(len(words16) // 2)]
    ka, end, out = int(k), 0, []
    for i in range(256):
        end += ka + ((0xAAAA >> (i % 16)) & 1)
        start = (end - 16) % (32 * len(words))
        v = (words[start // 32] << 32) | words[(start // 32 + 1) % len(words)]
        out.append((v >> (48 - start % 32)) & 0xFFFF)
    return out


# -- a reference encoder: exllamav3's two-pass tail-biting Viterbi over tiles ----------------------------------
def viterbi(w: torch.Tensor, k: int, lut: torch.Tensor) -> torch.Tensor:
    """The states [N, 256] whose codebook values are closest (squared error) to tiles w [N, 256] (fragment
    order): pass 1 over the rotated order finds where the register must start; pass 2 ends where it began."""
    n, edges = w.shape[0], 1 << (16 - k)
    values, in_edge = lut.float(), torch.arange(1 << 16) >> k

    def run(order: list[int], start: torch.Tensor | None):
        back = torch.empty(len(order), n, edges, dtype=torch.uint8)
        cost = None
        for step, pos in enumerate(order):
            err = (values[None, :] - w[:, pos, None]) ** 2
            if cost is None:
                c = err if start is None else torch.where(in_edge[None, :] == start[:, None], err, torch.inf)
            else:
                c = cost[:, in_edge] + err
            cost, back[step] = c.view(n, 1 << k, edges).min(1)
        return cost, back

    def trace(back: torch.Tensor, edge: torch.Tensor, order: list[int]) -> torch.Tensor:
        out, rows = torch.empty(n, 256, dtype=torch.int64), torch.arange(n)
        for step in range(len(order) - 1, -1, -1):
            s = (back[step][rows, edge].long() << (16 - k)) | edge
            out[:, order[step]] = s
            edge = s >> k
        return out

    rotated = [(i + 128) % 256 for i in range(256)]
    cost, back = run(rotated, None)
    start = trace(back, cost.argmin(1), rotated)[:, 0] >> k
    _, back = run(list(range(256)), start)
    return trace(back, start, list(range(256)))


def beam(w: torch.Tensor, k: int, lut: torch.Tensor, width: int = 64) -> torch.Tensor:
    """A fast encoder for whole models: beam search over the register (``width`` best paths per tile), the
    first state free and the symbols it implies at the end of the tile forced (tail-biting); within about
    1.3x Viterbi's error (measured: K=4 0.089 vs 0.067, K=6 0.039)."""
    n, mask, values = w.shape[0], (1 << k) - 1, lut.float()
    forced, options = math.ceil(16 / k) - 1, torch.arange(1 << k)
    cost, state = ((values[None, :] - w[:, :1]) ** 2).topk(width, largest=False)
    first, parents, symbols = state.clone(), [], []
    for p in range(1, 256 - forced):
        cand = ((state[..., None] << k) | options) & 0xFFFF
        cost, idx = (cost[..., None] + (values[cand] - w[:, p, None, None]) ** 2).reshape(n, -1).topk(
            width, largest=False)
        parents.append(idx >> k)
        symbols.append(idx & mask)
        state, first = cand.reshape(n, -1).gather(1, idx), first.gather(1, idx >> k)
    sym = torch.zeros(n, width, 256, dtype=torch.int64)
    path = torch.arange(width).expand(n, width)
    for p in range(255 - forced, 0, -1):  # each beam's symbols, back from its last position
        sym[:, :, p] = symbols[p - 1].gather(1, path)
        path = parents[p - 1].gather(1, path)
    sym[:, :, 0] = first & mask
    for s in range(1, forced + 1):
        sym[:, :, 256 - s] = (first >> (k * s)) & mask
    states = T.states_from_symbols(sym, k)
    best = ((values[states] - w[:, None, :]) ** 2).sum(-1).argmin(1)
    return states[torch.arange(n), best]


# -- the format pieces ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_codebook_values_match_the_formulas(codebook):
    rng = random.Random(0)
    states = [0, 1, 2, 3, 0x1234, 0x7FFF, 0x8000, 0xFFFF, *(rng.randrange(1 << 16) for _ in range(1500))]
    table = lookup_table(codebook)
    got = [float(table[s]) for s in states]
    assert got == [scalar_codebook(s, codebook) for s in states]
    # exllamav3 keeps 3INST's RMS as codebook_scale = 1.24371088; mcg is alike, mul1 about 1
    rms = float(table.float().pow(2).mean().sqrt())
    assert abs(rms - {"3inst": 1.24371088, "mcg": 1.2441118, "mul1": 1.0003121}[codebook]) < 1e-6


@pytest.mark.parametrize("k", range(1, 9))
def test_unpack_of_pack_round_trips_in_exllamav3s_bit_layout(k):
    symbols = torch.randint(0, 1 << k, (3, 2, 256))
    states = T.states_from_symbols(symbols, k)
    packed = T.pack(states, k)
    assert packed.dtype == torch.int16 and packed.shape == (3, 2, 16 * k)
    assert packed[1, 1].tolist() == scalar_pack(states[1, 1].tolist(), k)
    assert torch.equal(T.unpack(packed), states)


@pytest.mark.parametrize("k", [1.5, 2.5, 3.5])
def test_half_integer_bitrates_pack_and_unpack_as_exllamav3(k):
    """exllamav3 1.6 writes K = 1.5, 2.5, 3.5 with mul1 (16K int16 per tile): alternating KA- and KA+1-bit steps."""
    symbols = torch.randint(0, 1 << 8, (2, 3, 256))
    states = T.states_from_symbols(symbols, k)
    assert T.tail_biting(states, k).all()
    packed = T.pack(states, k)
    assert packed.shape == (2, 3, int(16 * k)) and T.bits_of(packed) == k
    assert packed[1, 2].tolist() == scalar_pack_frac(states[1, 2].tolist(), k)
    assert T.unpack(packed)[1, 2].tolist() == scalar_unpack_frac(packed[1, 2].tolist(), k) == states[1, 2].tolist()
    anything = torch.randint(-(1 << 15), 1 << 15, (3, int(16 * k)), dtype=torch.int16)
    assert T.unpack(anything)[2].tolist() == scalar_unpack_frac(anything[2].tolist(), k)
    assert T.tail_biting(T.unpack(anything), k).all()
    with pytest.raises(ValueError, match="16\\*K int16 values"):
        T.bits_from_width(int(16 * k) + 4)


@pytest.mark.parametrize("k", KS)
def test_tail_biting_invariant(k):
    states = T.states_from_symbols(torch.randint(0, 1 << k, (4, 256)), k)
    assert T.tail_biting(states, k).all()
    assert ((states[:, 0] >> k) == (states[:, 255] & ((1 << (16 - k)) - 1))).all()
    # any bit pattern read back is a tail-biting register (the stream is circular) ...
    anything = torch.randint(-(1 << 15), 1 << 15, (4, 16 * k), dtype=torch.int16)
    assert T.tail_biting(T.unpack(anything), k).all()
    # ... and a state changed on its own breaks the chain
    broken = states.clone()
    broken[:, 0] ^= 1 << 15
    assert not T.tail_biting(broken, k).any()


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", KS)
def test_reference_encoder_tiles_decode_within_the_expected_error(codebook, k):
    lut = lookup_table(codebook)
    torch.manual_seed(k)
    w = torch.randn(16, 32) * lut.float().pow(2).mean().sqrt()  # two tiles at the codebook's scale
    states = viterbi(T.matrix_to_tiles(w).reshape(2, 256), k, lut)
    assert T.tail_biting(states, k).all()
    decoded = T.decode(T.pack(states, k).reshape(1, 2, 16 * k), codebook).float()
    err = float((decoded - w).norm() / w.norm())
    # Gaussian source, trellis at K bits: about 0.26, 0.13, 0.067 (measured); what the export expects is looser
    assert err < {2: 0.30, 3: 0.16, 4: 0.085}[k] < expected_error(k), err


def test_hadamard_rotation_and_reconstruction():
    h = hadamard_128()
    i = torch.arange(BLOCK)
    signs = torch.tensor([[(-1) ** bin(a & b).count("1") for b in range(BLOCK)] for a in range(BLOCK)])
    assert torch.equal(torch.sign(h), signs.float()) and torch.allclose(h.abs(), torch.full_like(h, BLOCK ** -0.5))
    assert torch.allclose(h @ h, torch.eye(BLOCK), atol=1e-6) and torch.equal(h, h.T) and i.numel() == BLOCK
    w = torch.randn(256, 384)
    suh = torch.randn(256).sign() * (0.5 + torch.rand(256))
    svh = torch.randn(384).sign() * (0.5 + torch.rand(384))
    assert torch.allclose(reconstruct(regularize(w, suh, svh), suh, svh), w, atol=1e-5)
    with pytest.raises(ValueError, match="multiples of 128"):
        reconstruct(torch.zeros(100, 128), torch.ones(100), torch.ones(128))


# -- exllamav3's own output: samples of its converter and CUDA kernels (tests/data/exl3/README.md) ---------------
SAMPLES = Path(__file__).resolve().parent / "data" / "exl3" / "exl3_samples.safetensors"
# each sample (label/layer) with the K and codebook exllamav3 1.6.5 wrote it at: every kind of decode it has
SAMPLED = {"2/model.layers.0.self_attn.k_proj": (2, "mul1"), "3mcg/model.layers.0.self_attn.k_proj": (3, "mcg"),
           "3inst/model.layers.0.self_attn.k_proj": (3, "3inst"), "3.5/model.layers.0.self_attn.k_proj": (3.5, "mul1"),
           "4/model.layers.0.self_attn.k_proj": (4, "mul1"), "4/lm_head": (6, "mul1"),
           "8/model.layers.0.self_attn.k_proj": (8, "mul1")}
STORED = ("trellis", "suh", "svh")  # what exllamav3's converter writes per linear
KERNEL_TOLERANCE = 1e-3  # exllamav3's weight is fp16 and its kernels round in fp16: about 4.2e-4 from tuneport's fp32


def marker(codebook: str) -> torch.Tensor:
    """The marker exllamav3's quantizer stores beside a linear: its codebook's multiplier, 0-dim int32."""
    return torch.tensor(MULTIPLIERS[codebook], dtype=torch.uint32).view(torch.int)


@pytest.fixture(scope="module")
def samples() -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """sample -> (its metadata line, its tensors: trellis, suh, svh, w_hat_kernel, w_kernel)."""
    with safe_open(SAMPLES, "pt") as f:
        meta = f.metadata()
        return {s: (meta[s], {p.rsplit("/", 1)[1]: f.get_tensor(p) for p in f.keys() if p.startswith(f"{s}/")})
                for s in SAMPLED}


def kernel_errors(w: torch.Tensor, kernel: torch.Tensor) -> tuple[float, float]:
    """(||w - kernel|| / ||kernel||, max |w - kernel| / max |kernel|)."""
    diff, kernel = w.float() - kernel.float(), kernel.float()
    return float(diff.norm() / kernel.norm()), float(diff.abs().max() / kernel.abs().max())


@pytest.mark.parametrize("sample", SAMPLED)
def test_decoder_reproduces_exllamav3s_kernels(samples, sample):
    """tuneport's CPU decode of what exllamav3's converter wrote: W_hat bit for bit as exllamav3's CUDA decode
    gives it, and the weight (rotations and scales applied) within fp16 rounding of its kernel's."""
    k, codebook = SAMPLED[sample]
    meta, t = samples[sample]
    assert meta.startswith(f"K={k:g} codebook={codebook} ") and T.bits_of(t["trellis"]) == k
    w_hat = T.decode(t["trellis"], codebook)
    differ = int((w_hat.view(torch.int16) != t["w_hat_kernel"].view(torch.int16)).sum())
    assert differ == 0, f"{sample}: {differ} of {w_hat.numel()} decoded weights differ from exllamav3's"
    rel, peak = kernel_errors(reconstruct(w_hat, t["suh"], t["svh"]), t["w_kernel"])
    print(f"{sample} (K={k:g} {codebook}): w_hat bit-exact; w {rel:.2e} relative (norm), {peak:.2e} (max)")
    assert rel < KERNEL_TOLERANCE and peak < KERNEL_TOLERANCE, f"{sample}: {rel:.2e} (norm), {peak:.2e} (max)"
    other = next(cb for cb in CODEBOOKS if cb != codebook)  # the check tells codebooks apart
    assert kernel_errors(reconstruct(T.decode(t["trellis"], other), t["suh"], t["svh"]), t["w_kernel"])[0] > 0.5


def samples_dir(samples: dict, out: Path) -> dict[str, str]:
    """The samples as one EXL3 directory in exllamav3's layout, markers as its quantizer writes them; linear key ->
    sample."""
    keys = {s: "lm_head" if s.endswith("lm_head") else f"model.layers.{i}.self_attn.k_proj"
            for i, s in enumerate(SAMPLED)}
    tensors = {}
    for s, key in keys.items():
        tensors |= {f"{key}.{part}": samples[s][1][part] for part in STORED}
        if (codebook := SAMPLED[s][1]) != "3inst":
            tensors[f"{key}.{codebook}"] = marker(codebook)
    assert len(tensors) == len(keys) * len(STORED) + sum(cb != "3inst" for _, cb in SAMPLED.values())
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": len(keys) - 1,
        "quantization_config": {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6,
                                "codebook": "mul1"}}))
    return {key: s for s, key in keys.items()}


def test_exl3_model_reads_exllamav3s_samples(samples, tmp_path):
    """The reader on exllamav3's own tensors: each linear's K and codebook (from its trellis width and marker)
    as exllamav3 wrote them, and ``weight_rows`` (128 rows at a time) equal to the whole-layer decode, within fp16
    rounding of exllamav3's kernel."""
    keys = samples_dir(samples, tmp_path / "exl3")
    model = Exl3Model(tmp_path / "exl3")
    assert {key: (model.linears[key].bits, model.linears[key].codebook) for key in keys} == {
        key: SAMPLED[s] for key, s in keys.items()}
    assert model.summary()["codebooks"] == sorted(CODEBOOKS) and len(model.linears) == len(SAMPLED)
    for key, s in keys.items():
        t = samples[s][1]
        rows = [w for _, w in model.weight_rows(key, rows=BLOCK)]
        assert len(rows) == t["suh"].numel() // BLOCK >= 2
        w = torch.cat(rows)
        assert torch.equal(w, reconstruct(T.decode(t["trellis"], SAMPLED[s][1]), t["suh"], t["svh"]))
        assert max(kernel_errors(w, t["w_kernel"])) < KERNEL_TOLERANCE, s


@pytest.mark.parametrize("stored, message", [
    (torch.tensor(0, dtype=torch.int32), "holds 0x00000000, not the mcg multiplier 0xcbac1fed"),
    (marker("mul1"), "holds 0x83dcd12d, not the mcg multiplier 0xcbac1fed"),  # another codebook's multiplier
    (torch.tensor(0x2C8F1D6B, dtype=torch.int32), "holds 0x2c8f1d6b, not the mcg"),  # a 0.0.3-0.0.8 --mcg_multiplier
    (torch.tensor([MULTIPLIERS["mcg"]], dtype=torch.int64), r"is int64 of shape \[1\], not a 0-dim int32"),
], ids=["zero", "mul1-multiplier", "user-multiplier", "int64-vector"])
def test_codebook_markers_must_hold_their_multiplier(samples, tmp_path, stored, message):
    """exllamav3 stores the codebook's multiplier in the marker (and 1.6 checks it): any other value is a codebook
    tuneport cannot decode, refused by name; 0 included, which no exllamav3 version writes."""
    from safetensors.torch import load_file

    keys = samples_dir(samples, tmp_path / "exl3")
    key = next(k for k, s in keys.items() if SAMPLED[s][1] == "mcg")
    assert int(load_file(tmp_path / "exl3" / "model.safetensors")[f"{key}.mcg"]) & 0xFFFFFFFF == 0xCBAC1FED
    assert marker_problem("mcg", marker("mcg")) is None and marker_problem("mul1", marker("mul1")) is None
    assert marker_problem("mcg", marker("mcg").view(torch.uint32)) is None  # a U32 tensor holds the same bits
    tensors = load_file(tmp_path / "exl3" / "model.safetensors")
    save_file({**tensors, f"{key}.mcg": stored}, tmp_path / "exl3" / "model.safetensors")
    with pytest.raises(UserError, match=f"the codebook marker {key}.mcg {message}") as e:
        Exl3Model(tmp_path / "exl3")
    assert "a codebook tuneport cannot decode" in str(e.value) and "exllamav3 0.0.9 or later" in e.value.hint


# -- an EXL3 directory as exllamav3 writes it -----------------------------------------------------------------
def pad128(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def write_exl3(src: Path, out: Path, bits: int = 4, head_bits: int = 6, codebooks=("mcg", "mul1", "3inst")) -> None:
    """``src`` (an HF directory) written in exllamav3's layout: every linear (and the head; each expert of a
    mixture of experts, not its router) padded to 128, rotated, encoded (beam search) and packed, with suh/svh and
    markers; the rest copied as fp16."""
    from tuneport.convert.checkpoint import Checkpoint

    ck = Checkpoint(src)
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    experts = ck.arch.experts if ck.arch else None  # exllamav3 keeps a mixture of experts' routers fp16
    router = f".{experts.disk_block}.{experts.router}.weight" if experts else "no router"
    weights = {n: ck.read(n) for n in ck.names() if n.endswith(".weight") and len(ck.meta(n).shape) == 2
               and "embed" not in n and not n.endswith(router)}
    if ck.tied_embeddings:
        weights["lm_head.weight"] = ck.read("model.embed_tokens.weight")
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        fused = weights.pop(name)  # exllamav3 stores these split, by output rows (phi3)
        cfg, stem = ck.config, name.rsplit(".", 2)[0]
        hd = cfg["hidden_size"] // cfg["num_attention_heads"]
        parts = ({"q_proj": cfg["num_attention_heads"] * hd, "k_proj": cfg["num_key_value_heads"] * hd,
                  "v_proj": cfg["num_key_value_heads"] * hd} if "qkv" in name
                 else {"gate_proj": cfg["intermediate_size"], "up_proj": cfg["intermediate_size"]})
        for part, chunk in zip(parts, fused.split(list(parts.values())), strict=True):
            weights[f"{stem}.{part}.weight"] = chunk
    for j, name in enumerate(sorted(weights)):
        key = name[: -len(".weight")]
        w = weights[name].float()  # [out, in]
        k, cb = (head_bits, "3inst") if key == "lm_head" else (bits, codebooks[j % len(codebooks)])
        wt = torch.zeros(pad128(w.shape[1]), pad128(w.shape[0]))
        wt[: w.shape[1], : w.shape[0]] = w.T
        gen = torch.Generator().manual_seed(j)
        svh = torch.where(torch.rand(wt.shape[1], generator=gen) < 0.5, -1.0, 1.0).half()
        rms = wt.pow(2).mean(1).sqrt().clamp_min(1e-3)
        scale = lookup_table(cb).float().pow(2).mean().sqrt()  # rows at the codebook's RMS (exllamav3 also
        suh = (torch.where(torch.rand(wt.shape[0], generator=gen) < 0.5, -1.0, 1.0) * rms / scale).half()  # scales)
        w_hat = regularize(wt, suh, svh)
        states = beam(T.matrix_to_tiles(w_hat).reshape(-1, 256), k, lookup_table(cb))
        tensors[f"{key}.trellis"] = T.pack(states, k).reshape(wt.shape[0] // 16, wt.shape[1] // 16, 16 * k)
        tensors[f"{key}.suh"], tensors[f"{key}.svh"] = suh, svh
        if cb != "3inst":
            tensors[f"{key}.{cb}"] = marker(cb)
    for name in ck.names():
        if name not in weights and not name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            tensors[name] = ck.read(name).half()
    save_file(tensors, out / "model.safetensors")
    cfg = dict(ck.config, quantization_config={"quant_method": "exl3", "version": "1.4.1", "bits": float(bits),
                                               "head_bits": head_bits, "codebook": "mcg",
                                               "calibration": {"rows": 250, "cols": 2048}, "out_scales": "always"})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ck.side_files():
        shutil.copy(f, out / f.name)


def cached_exl3(src: Path, **settings) -> Path:
    """``write_exl3(src, ..., **settings)`` built once and kept in the fixture cache, keyed by content: the base's
    files, the settings and the source of this module and of the trellis code it encodes with."""
    import hashlib

    from tuneport.convert.cache import write_once
    from tuneport.convert.exl3 import codebook, hadamard
    from tuneport.toolkit.tiny.trained import fixture_cache

    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for f in [Path(__file__), Path(T.__file__), Path(codebook.__file__), Path(hadamard.__file__),
              *sorted(p for p in src.iterdir() if p.is_file())]:
        h.update(f.name.encode() + f.read_bytes())
    return write_once(fixture_cache() / f"exl3-{h.hexdigest()[:16]}", lambda tmp: write_exl3(src, tmp, **settings))


def decoded_reference(exl3: Path, src: Path, out: Path, noise: float = 1e-3) -> None:
    """``src`` with each linear replaced by the EXL3 directory's decoded weight (cut to size) plus relative
    ``noise``: the merged weights an exact converter would have started from."""
    from tuneport.convert.checkpoint import Checkpoint

    model, ck = Exl3Model(exl3), Checkpoint(src)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name in ck.names():
        w = ck.read(name).float()
        key = name.removesuffix(".weight")
        if name == "model.embed_tokens.weight" and ck.tied_embeddings:
            key = "lm_head"  # the head was quantized from the tied embedding
        if key in model.linears:
            d = model.weight(key)[: w.shape[0], : w.shape[1]]
            w = d + noise * d.norm() / d.numel() ** 0.5 * torch.randn(d.shape, generator=gen)
        tensors[name] = w.half().contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    for f in [src / "config.json", *ck.side_files()]:
        shutil.copy(f, out / f.name)


@pytest.fixture(scope="module")
def exl3_dirs(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("exl3")
    src = zoo.base("llama", tied=True)  # the head is quantized from the tied embedding
    shutil.copytree(cached_exl3(src), root / "exl3")  # a copy: some tests corrupt it
    decoded_reference(root / "exl3", src, root / "merged")
    return root / "exl3", root / "merged"


def test_exl3_reader_and_decode_check(exl3_dirs):
    from tuneport.convert.checkpoint import Checkpoint

    exl3, merged = exl3_dirs
    model = Exl3Model(exl3)
    assert set(model.linears) >= {"model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj", "lm_head"}
    k_proj = model.linears["model.layers.0.self_attn.k_proj"]
    assert (k_proj.in_features, k_proj.out_features, k_proj.bits) == (128, 128, 4)  # 64 outputs padded to 128
    assert model.linears["lm_head"].bits == 6 and model.linears["lm_head"].codebook == "3inst"
    assert {lin.codebook for lin in model.linears.values()} == set(CODEBOOKS)
    report = decode_check(model, Checkpoint(merged))
    assert len(report["layers"]) == len(model.linears) and report["worst"] < 3e-3
    assert report["summary"]["codebooks"] == sorted(CODEBOOKS)


def test_decode_check_refuses_weights_that_do_not_match(exl3_dirs, zoo, tmp_path):
    from tuneport.convert.checkpoint import Checkpoint

    exl3, _ = exl3_dirs
    decoded_reference(exl3, zoo.base("llama", tied=True), tmp_path / "other", noise=10.0)  # other weights
    with pytest.raises(FidelityError, match=r"decodes 0\.99\d* away from the merged weights \(15 of 15 layers past "):
        decode_check(Exl3Model(exl3), Checkpoint(tmp_path / "other"))
    decoded_reference(exl3, zoo.base("llama", tied=True), tmp_path / "far", noise=0.3)  # worse than expected:
    report = decode_check(Exl3Model(exl3), Checkpoint(tmp_path / "far"))  # reported, not refused
    assert len(report["above_expected"]) == 15 and MISMATCH > report["worst"] > expected_error(4)


@pytest.mark.slow  # the reference encoder takes 20-90 s a model on 2 cores (a mixture of experts: more)
@pytest.mark.parametrize("arch", supported("exl3"))
def test_every_architecture_writes_and_decodes(zoo, tmp_path, arch):
    """Every architecture of the table, in exllamav3's layout (written by the reference encoder here; the real
    converter needs CUDA): each quantized linear is found, decoded and checked against the merged weights. A
    mixture of experts is quantized one linear per expert, its router left fp16, and checked against the
    checkpoint's experts whether it keeps them per expert or fused (transformers 5's layout)."""
    from tuneport.convert.checkpoint import Checkpoint

    model = Exl3Model(cached_exl3(zoo.base(arch), bits=2, head_bits=2))  # 2 bits: about twice as fast to encode
    report = decode_check(model, Checkpoint(zoo.base(arch)))
    assert len(report["layers"]) == len(model.linears) >= 2 * 7 and report["worst"] < expected_error(2)
    experts = Checkpoint(zoo.base(arch)).arch.experts
    if experts is None:
        return
    cfg = Checkpoint(zoo.base(arch)).config
    n, layers = experts.expert_count(cfg), cfg["num_hidden_layers"]
    expert_keys = [k for k in model.linears if ".experts." in k]
    assert len(expert_keys) == layers * n * 3 and len(model.linears) == layers * (4 + 3 * n) + 1
    assert f"model.layers.1.{experts.disk_block}.experts.{n - 1}.{experts.down}" in model.linears
    assert not any(k.endswith(f".{experts.router}") for k in model.linears)  # the routers: fp16, not checked
    fused = decode_check(model, Checkpoint(zoo.fused_base(arch)))  # the same weights, experts fused on disk
    assert fused["layers"] == report["layers"]
    errors = [report["layers"][k]["relative_error"] for k in expert_keys]
    assert 0.1 < min(errors) <= max(errors) < expected_error(2), errors  # 2 bits: about 0.26 each


def test_decode_check_reads_fused_linears_exllamav3_splits(zoo, tmp_path):
    """phi3 keeps q/k/v and gate/up fused; exllamav3 quantizes them split: each part is checked against its rows
    of the fused weight, and no layer is left unchecked."""
    from tuneport.convert.checkpoint import Checkpoint

    model = Exl3Model(cached_exl3(zoo.base("phi3")))
    assert "model.layers.0.self_attn.k_proj" in model.linears and "model.layers.0.mlp.up_proj" in model.linears
    report = decode_check(model, Checkpoint(zoo.base("phi3")))
    assert len(report["layers"]) == 2 * 7 + 1 and report["worst"] < expected_error(4)
    with pytest.raises(FidelityError, match=r"decodes 1\.\d+ away .* not the same weights"):
        decode_check(model, Checkpoint(zoo.base("llama")))  # another model's q/k/v/o and mlp weights
    lacking = tmp_path / "lacking"  # a reference without some of the quantized layers: refused, not skipped
    lacking.mkdir()
    shutil.copy(zoo.base("phi3") / "config.json", lacking)
    save_file({"model.embed_tokens.weight": Checkpoint(zoo.base("phi3")).read("model.embed_tokens.weight")},
              lacking / "model.safetensors")
    with pytest.raises(UserError, match="no unquantized weight for model.layers.0.mlp.down_proj in "):
        decode_check(model, Checkpoint(lacking))


def test_expert_linears_map_to_the_checkpoints_experts(zoo):
    """exllamav3 quantizes each expert's projection under its architecture file's name (Mixtral
    ``block_sparse_moe.experts.E.w1``, Qwen3-MoE ``mlp.experts.E.gate_proj``): the decode check finds the expert in
    the checkpoint, stored per expert or fused (transformers 5), also under transformers 5's names."""
    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.convert.exl3.read import reference_rows

    for arch, key, name in [
        ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2", "model.layers.1.block_sparse_moe.experts.3.w2"),
        ("mixtral", "model.layers.1.mlp.experts.3.down_proj", "model.layers.1.block_sparse_moe.experts.3.w2"),
        ("mixtral", "model.layers.0.mlp.experts.2.up_proj", "model.layers.0.block_sparse_moe.experts.2.w3"),
        ("qwen3_moe", "model.layers.0.mlp.experts.1.gate_proj", "model.layers.0.mlp.experts.1.gate_proj"),
    ]:
        per_expert, fused = Checkpoint(zoo.base(arch)), Checkpoint(zoo.fused_base(arch))
        with safe_open(fused.path / "model.safetensors", "pt") as f:  # stored fused, read per expert
            assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys() and f"{name}.weight" not in f.keys()
        want = per_expert.read(f"{name}.weight")
        for ckpt in (per_expert, fused):
            assert expert_reference(ckpt, key) == f"{name}.weight"
            assert torch.equal(reference_rows(ckpt, key, None), want)
    llama = Checkpoint(zoo.base("llama"))
    assert expert_reference(llama, "model.layers.0.mlp.experts.0.gate_proj") is None
    assert expert_reference(Checkpoint(zoo.base("mixtral")), "model.layers.0.block_sparse_moe.experts.9.w1") is None


def test_inspect_exl3_shows_bits_per_layer_and_codebook(exl3_dirs, cli):
    exl3, _ = exl3_dirs
    code, out, err = cli("inspect", exl3)
    assert code == 0, err
    assert "exl3-model" in out and "exl3 4.0 bpw" in out and "head 6 bits" in out
    assert "model.layers.0: 7x 4-bit" not in out and "model.layers.0:" in out and "lm_head: 1x 6-bit 3inst" in out
    code, out, _ = cli("inspect", exl3, "--json")
    r = json.loads(out)
    assert r["engines"]["exllamav3"]["loads"] and not r["engines"]["vllm"]["loads"]
    assert r["quantization"]["quantized_linears"] == 15 and r["quantization"]["average_bits"] > 4


# -- export --target exl3 on a machine without CUDA -----------------------------------------------------------
def test_export_exl3_fails_fast_without_cuda(zoo, tmp_path, cli):
    out = tmp_path / "out"
    code, stdout, err = cli("export", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"),
                            "--target", "exl3", "--out", out)
    assert code == 2 and stdout == ""
    assert err.strip().splitlines() == [err.strip()] and "EXL3 conversion needs a CUDA GPU" in err
    assert "pip install exllamav3" in err and "Traceback" not in err
    assert listdir(tmp_path) == []  # no output, no work directory


def test_export_exl3_dry_run_prints_the_plan_and_the_converter_command(zoo, tmp_path, cli):
    out = tmp_path / "out"
    args = ["export", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"), "--target", "exl3",
            "--out", out, "--bits", "3.5", "--head-bits", "8", "--codebook", "mcg", "--dry-run"]
    code, stdout, err = cli(*args)
    assert code == 0, err
    work = tmp_path / "out.exl3-work"
    assert f"python convert.py -i {work}/merged -o {work}/converted -w {work}/job -b 3.5 -hb 8 -cb mcg" in stdout
    assert stdout.startswith(f"would write exl3 to {out}") and "lacks a CUDA GPU" in stdout
    assert listdir(tmp_path) == []
    code, stdout, _ = cli(*args, "--json")
    r = json.loads(stdout)
    assert r["dry_run"] and not r["resume"] and r["requirements"]["cuda"] is False
    assert r["command"][1] == "-c" and r["command"][3:] == ["-i", f"{work}/merged", "-o", f"{work}/converted", "-w",
                                                            f"{work}/job", "-b", "3.5", "-hb", "8", "-cb", "mcg"]
    # resuming an interrupted run is in test_export_exl3_end_to_end_resumes_and_checks_every_layer


@pytest.mark.parametrize("args, message", [
    (["--target", "gguf", "--bits", "4"], "--bits does not apply to --target gguf"),
    (["--target", "awq", "--dry-run"], "--dry-run does not apply to --target awq"),
    (["--target", "exl3", "--adapters", "separate"], "--target exl3 writes --adapters merge only"),
    (["--target", "exl3", "--bits", "9"], "--bits 9 is outside exllamav3's range"),
    (["--target", "exl3", "--head-bits", "12"], "--head-bits 12 is not one exllamav3 writes"),
    (["--target", "exl3", "--head-bits", "3.5", "--codebook", "mcg"], "--head-bits 3.5 needs the mul1 codebook"),
    (["--target", "exl3", "--codebook", "e8p"], "unknown --codebook 'e8p'"),
])
def test_exl3_options_are_checked(zoo, tmp_path, cli, args, message):
    code, _, err = cli("export", "--base", zoo.base("llama"), "--out", tmp_path / "o", *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


# -- the whole export, with a stand-in converter (exllamav3's own needs CUDA) --------------------------------
@pytest.fixture
def stand_in_converter(monkeypatch):
    """tests/fake_exllamav3: exllamav3's converter command line over the reference encoder above, found as
    the installed package (here and in the converter's process), with torch told that CUDA is there."""
    import os

    here = Path(__file__).resolve().parent
    monkeypatch.syspath_prepend(str(here / "fake_exllamav3"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here / "fake_exllamav3"), str(here),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.slow  # ~20 s: the stand-in converter encodes every linear twice (the crash, then the resume)
def test_export_exl3_end_to_end_resumes_and_checks_every_layer(zoo, tmp_path, cli, stand_in_converter,
                                                               monkeypatch):
    out, work = tmp_path / "out", tmp_path / "out.exl3-work"
    args = ["export", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"), "--target", "exl3",
            "--out", out, "--bits", "4", "--codebook", "mcg"]
    monkeypatch.setenv("TEST_EXL3_FAIL_AFTER", "3")  # the converter dies after 3 linears
    code, _, err = cli(*args)
    assert code == 2 and "exllamav3's converter failed (exit 1): CUDA out of memory (simulated)" in err
    assert f"it resumes from {work}/job" in err and not out.exists()
    assert (work / "merged" / "manifest.json").is_file() and (work / "job" / "args.json").is_file()
    code, stdout, _ = cli(*args, "--dry-run", "--json")
    plan = json.loads(stdout)
    assert plan["resume"] and plan["command"][-3:] == ["-cb", "mcg", "-r"] and "reused" in plan["plan"][0]
    code, _, err = cli(*args[:-4], "--bits", "3", "--codebook", "mcg")  # other settings: the job is kept
    assert code == 2 and "holds an unfinished conversion made from other inputs or settings" in err
    assert (work / "job" / "args.json").is_file()
    monkeypatch.delenv("TEST_EXL3_FAIL_AFTER")
    code, stdout, err = cli("--log-level", "info", *args, "--json")
    assert code == 0, err
    assert "Resuming existing job" in err and "Creating new job" not in err  # the converter's own resume
    assert not work.exists() and listdir(tmp_path) == ["out"]
    assert {"model.safetensors", "config.json", "manifest.json", "tabby-config.yml"} <= set(listdir(out))
    manifest = json.loads((out / "manifest.json").read_text())
    check = manifest["decode_check"]
    assert len(check["layers"]) == 2 * 7 + 1  # every linear and the head
    assert not check["above_expected"] and check["fail_above"] == MISMATCH, check["layers"]
    assert {v["codebook"] for v in check["layers"].values()} == {"mcg", "3inst"}  # the head: 3inst (the writer's)
    assert 0.03 < check["layers"]["model.layers.0.mlp.down_proj"]["relative_error"] < expected_error(4)
    tabby = yaml_load(out / "tabby-config.yml")
    assert tabby["model"]["model_dir"] == str(tmp_path) and tabby["model"]["model_name"] == "out"
    assert json.loads(stdout)["decode_check"]["worst"] == check["worst"]
    code, stdout, _ = cli("inspect", out)
    assert code == 0 and "exl3-model" in stdout


def yaml_load(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())
