"""``export --target gguf``: model file(s) per quant type, GGUF LoRAs, Ollama Modelfiles, manifest."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from ..arch import ArchSpec, arch_for
from ..atomic import atomic_dir
from ..errors import UserError
from ..export_hf import copy_side_files
from ..inputs import Progress, open_inputs
from ..manifest import input_entries, write_manifest
from ..merge import MergePlan, merge_one, plan_merge
from ..options import ExportOptions, ExportResult, model_name
from .imatrix import IMatrix, calibration_arch, compute_imatrix, write_imatrix
from .lora import build_gguf_lora, write_gguf_lora
from .model import GGUFModelPlan, plan_gguf_model, write_gguf_models
from .modelfile import modelfile
from .quant_types import QUANT_TYPES, QuantType, parse_quant_list
from .quantize import IMATRIX_HINT, quantize_with_llamacpp
from .runtime import check_loads
from .tokenizer_check import TokenizerReport, check_gguf_tokenizer
from .vocab import HF_TOKENIZER_DIR, GGUFVocab, general_name, read_vocab

log = logging.getLogger(__name__)
LOSSLESS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
IMATRIX_FILE = "imatrix.gguf"


def lossless_type(dtype: torch.dtype) -> QuantType:
    return QUANT_TYPES[LOSSLESS.get(dtype, "f32")]


def wants_imatrix(opts: ExportOptions, quants: list[QuantType], arch: ArchSpec) -> bool:
    """An importance matrix is computed iff --calib, --calib-samples or --calib-seqlen is given; refuse types
    llama.cpp cannot write without one, and architectures the calibration pass does not run."""
    want = bool(opts.calib or opts.calib_samples or opts.calib_seqlen)
    needs = [q.name for q in quants if q.needs_imatrix]
    if needs and not want:
        raise UserError(f"--quant {', '.join(needs)} need{'s' if len(needs) == 1 else ''} an importance matrix",
                        IMATRIX_HINT)
    if want:
        calibration_arch(arch.model_type)
    return want


def build_imatrix(opts: ExportOptions, plan: MergePlan, arch: ArchSpec, tok_dir: Path) -> tuple[IMatrix, dict]:
    """The calibration text through the (merged) model, one block at a time: (matrix, calibration description)."""
    from transformers import AutoTokenizer

    from ..calibration.text import load_calibration

    max_len = plan.config.get("max_position_embeddings")
    calib = load_calibration(AutoTokenizer.from_pretrained(tok_dir), opts.calib, opts.calib_samples,
                             opts.calib_seqlen or None, max_len)  # its default seqlen fits the context
    log.info("importance matrix: %d samples of %d tokens from %s", *calib.ids.shape, calib.source)
    return compute_imatrix(plan, arch, calib.ids, dataset=calib.source), calib.describe()


def prove_loads(models: list[Path], loras: list[Path]) -> str:
    """Every exported model and LoRA opened by llama.cpp before the output is renamed into place (UserError
    with llama.cpp's reason when one does not load); what was checked, for the manifest."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "not checked: llama-cpp-python is not installed (pip install 'tuneport[llamacpp]')"
    for i, model in enumerate(models):
        check_loads(model, loras if i == 0 else ())
    return f"loaded by llama.cpp: {len(models)} model(s), {len(loras)} adapter(s)"


def check_tokenizer(model: Path, tok_dir: Path, vocab: GGUFVocab, accept: bool, shown: Path) -> TokenizerReport | None:
    """The written file's tokenizer in llama.cpp against HF's (the battery, the chat template with and without a
    system message and with tools, special ids and token types): UserError naming what differs unless
    ``accept`` (--accept-tokenizer-difference); the report (None without llama-cpp-python)."""
    from transformers import AutoTokenizer

    report = check_gguf_tokenizer(model, AutoTokenizer.from_pretrained(tok_dir), vocab.inexact)
    if report is not None and not report.passed and not accept:
        raise UserError(f"llama.cpp would tokenize differently from the tokenizer in {shown}: {report.failure()}",
                        "pass --accept-tokenizer-difference to write the GGUF anyway (recorded in its manifest; "
                        "tuneport serve then tokenizes prompts with the HF tokenizer, kept beside it, so its answers "
                        "are exact), or export --target mlx or vllm, which run the HF tokenizer")
    return report


def export_gguf(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """Write ``out/<name>-<QUANT>.gguf`` for every type (one conversion feeds them all), GGUF LoRAs under
    ``adapters/`` for ``--adapters separate``, a Modelfile per model/adapter, and manifest.json."""
    mode, out = opts.adapter_mode, opts.out
    quants = parse_quant_list(opts.quant)
    ckpt, loaded = open_inputs(opts, "gguf")
    arch = arch_for(ckpt.model_type)
    with_imatrix = wants_imatrix(opts, quants, arch)
    name = opts.name or model_name(ckpt.spec)
    if mode == "merge" or not loaded:
        plan = plan_merge(ckpt, loaded if mode == "merge" else [])
        loras = []
    else:
        plan = plan_merge(ckpt, [])
        loras = [(w.adapter, build_gguf_lora(w.adapter, ckpt, arch)) for w in loaded]  # refuses before writing
    specs = {s.name: s for s in plan.specs}
    lossless = lossless_type(plan.matrix_dtype)
    direct = [q for q in quants if q.direct]
    via_llamacpp = [q for q in quants if not q.direct]
    if via_llamacpp and lossless not in direct:
        direct = [lossless, *direct]

    with atomic_dir(out, force=opts.force) as tmp:
        scratch = tmp / ".scratch"  # intermediate files; removed before the output is renamed into place
        tok_dir = scratch / "tokenizer"
        tok_dir.mkdir(parents=True)
        copy_side_files(plan, tok_dir)
        # transformers picks tokenizer behaviour by the model type too (Mistral's): the tokenizer checked, and the
        # one serve uses, is the model directory's
        shutil.copy2(ckpt.path / "config.json", tok_dir / "config.json")
        n_vocab = plan.specs[[s.name for s in plan.specs].index(f"{arch.embed}.weight")].shape[0]
        vocab = read_vocab(tok_dir, n_vocab, opts.bpe_pre, shown=ckpt.path)
        in_file, renamed = general_name(name, vocab)
        imatrix, calibration = build_imatrix(opts, plan, arch, tok_dir) if with_imatrix else (None, None)
        shapes = [(s.name, s.shape) for s in plan.specs]
        files: dict[str, Path] = {}
        targets: list[tuple[Path, GGUFModelPlan, int]] = []
        for q in direct:
            path = (tmp if q in quants else scratch) / f"{name}-{q.label}.gguf"
            files[q.name] = path
            targets.append((path, plan_gguf_model(arch, plan.config, shapes, q.direct), q.ftype))
        notes = [*plan.notes, *targets[0][1].facts.notes, *([renamed] if renamed else [])]
        hashes = write_gguf_models(targets, vocab, lambda n: merge_one(plan, specs[n]), name=in_file,
                                   progress=progress)
        for q in via_llamacpp:
            files[q.name] = tmp / f"{name}-{q.label}.gguf"
            quantize_with_llamacpp(files[lossless.name], files[q.name], q, imatrix=imatrix)
        if imatrix is not None:
            write_imatrix(imatrix, tmp / IMATRIX_FILE, arch.gguf_arch)
        warnings: list[str] = []
        lora_files = {}
        if loras:
            (tmp / "adapters").mkdir()
        for adapter, lora in loras:
            path = tmp / "adapters" / f"{adapter.name}-F32.gguf"
            write_gguf_lora(path, lora, adapter.name)
            lora_files[adapter.name] = path
        load_check = prove_loads([files[q.name] for q in quants], list(lora_files.values()))
        if not load_check.startswith("loaded"):
            warnings.append(f"GGUF files {load_check}")
        tokenizer = check_tokenizer(files[quants[0].name], tok_dir, vocab, opts.accept_tokenizer_difference,
                                    ckpt.path)
        if tokenizer is None:
            warnings.append("tokenizer not checked in llama.cpp: llama-cpp-python is not installed")
        elif not tokenizer.passed:
            notes.append(f"accepted risk (--accept-tokenizer-difference): {tokenizer.failure()}; tuneport serve "
                         f"tokenizes prompts with the HF tokenizer kept in {HF_TOKENIZER_DIR}/")
            shutil.copytree(tok_dir, tmp / HF_TOKENIZER_DIR)
        shutil.rmtree(scratch)
        main = quants[0]
        eos = vocab.tokens[vocab.special["eos"]] if "eos" in vocab.special else None
        bos = vocab.tokens[vocab.special["bos"]] if "bos" in vocab.special else None
        text, warn = modelfile(files[main.name].name, vocab.chat_template, eos=eos, bos=bos)
        (tmp / "Modelfile").write_text(text)
        warnings += [warn] if warn else []
        for aname, path in lora_files.items():
            text, _ = modelfile(files[main.name].name, vocab.chat_template, f"adapters/{path.name}", eos=eos,
                                bos=bos)
            (tmp / f"Modelfile.{aname}").write_text(text)
        details = {"models": {q.name: files[q.name].name for q in quants},
                   "loras": {a: f"adapters/{p.name}" for a, p in lora_files.items()},
                   "folded_scales": {a.name: lora.folded for a, lora in loras if lora.folded},
                   "load_check": load_check, "tokenizer_check": tokenizer.as_dict() if tokenizer else None,
                   "hf_tokenizer": HF_TOKENIZER_DIR if (tmp / HF_TOKENIZER_DIR).is_dir() else None}
        if imatrix is not None:
            details["calibration"] = calibration
            details["imatrix"] = {"file": IMATRIX_FILE, **imatrix.describe(),
                                  "used_for": [q.name for q in via_llamacpp]}
        manifest = write_manifest(tmp, "gguf", input_entries(ckpt, loaded), known_hashes=hashes, options={
            "adapters": mode, "quant": [q.name for q in quants],
            "bpe_pre": vocab.pre if vocab.model == "gpt2" else None,
            "calib": str(opts.calib) if opts.calib else None, "calib_samples": opts.calib_samples,
            "calib_seqlen": opts.calib_seqlen, "accept_config_keys": opts.accept_config_keys,
            "accept_tokenizer_difference": opts.accept_tokenizer_difference, "notes": notes},
            extra={**details, "warnings": warnings})
    return ExportResult(out, "gguf", manifest, notes=notes, warnings=warnings, details=details)
