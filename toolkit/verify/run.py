"""``tuneport verify``: run an artifact in its own engine and compare it with the fp32 fine-tune."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tuneport.convert.errors import FidelityError, UserError
from tuneport.convert.mlx.read import mlx_model_info
from tuneport.convert.options import coerce_options
from tuneport.convert.tokenizer_parity import chat_template_parity, special_tokens_parity, tokenizer_parity

from ..fidelity import compare_logits
from .gates import METRICS, parse_gates
from .reference import greedy_prompt, reference


@dataclass(kw_only=True)
class VerifyOptions:
    artifact: Path  # a GGUF model file, a tuneport vLLM bundle or a merged HF model directory
    reference: str | Path  # the fine-tune's base: HF directory or hub id
    adapter: str | Path | None = None  # the fine-tune's PEFT adapter (the reference is base + adapter)
    lora: Path | None = None  # a GGUF LoRA (GGUF) or PEFT dir (vLLM) to run on it; strength checked vs PEFT
    eval_file: Path | None = None  # text to compare on (default: a built-in offline corpus)
    tokens: int = 256  # eval tokens
    greedy_tokens: int = 16
    gates: list[str] = field(default_factory=list)  # METRIC<=X, METRIC>=X or a check, on top of the defaults
    default_gates: bool = True  # tokenizer, chat_template, special_tokens, strength_error<=0.1
    gpu_layers: int | str | None = None  # GGUF: layers llama.cpp keeps in VRAM (None: all on a GPU build, else 0)


@dataclass
class VerifyReport:
    artifact: str
    lora: str | None
    reference: str
    adapter: str | None
    engine: str
    tokens: int
    metrics: dict[str, float | None]
    checks: dict[str, dict]
    gates: list[dict]

    @property
    def passed(self) -> bool:
        return all(g["passed"] for g in self.gates)

    @property
    def failures(self) -> list[dict]:
        return [g for g in self.gates if not g["passed"]]

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def failure_line(self) -> str:
        what = Path(self.artifact).name + (f" + {Path(self.lora).name}" if self.lora else "")
        return f"{what} failed " + "; ".join(
            f"{g['gate']} ({_value(g['value'])}: {g['detail']})" for g in self.failures)


def _value(v) -> str:
    return ("pass" if v else "FAIL") if isinstance(v, bool) else f"{v:.3g}"


# Artifact kinds verify runs, by what the path is: (test, "module:class" of the runner under toolkit.verify).
ARTIFACT_KINDS: tuple[tuple[Callable[[Path], bool], str], ...] = (
    (lambda p: p.suffix == ".gguf", "gguf_runner:GGUFRunner"),  # llama.cpp
    (lambda p: mlx_model_info(p) is not None, "mlx_runner:MlxRunner"),  # an MLX LM directory: mlx-lm
    (lambda p: _is_4bit_without_vllm(p), "dequant_runner:DequantizedRunner"),  # 4-bit where vLLM cannot run it
    (lambda p: p.is_dir(), "vllm_runner:VllmRunner"),  # a vLLM bundle or a merged HF model: vLLM
)


def _is_4bit_without_vllm(path: Path) -> bool:
    from .dequant_runner import is_4bit_dir, vllm_cannot_run_4bit

    return path.is_dir() and is_4bit_dir(path) and vllm_cannot_run_4bit(path)


def _runner_for(opts: VerifyOptions):
    import importlib

    path = Path(opts.artifact)
    if not path.exists():
        raise UserError(f"{path} does not exist",
                        "pass the artifact to verify: a .gguf model file, an MLX directory, a vLLM bundle or an HF "
                        "model directory")
    for matches, target in ARTIFACT_KINDS:
        if matches(path):
            module, cls = target.split(":")
            return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
    raise UserError(f"tuneport verify cannot run {path.name}",
                    "pass a .gguf model file (a GGUF LoRA with --lora), an MLX directory (an mlx-lm adapter with "
                    "--lora), a vLLM bundle or an HF model directory")


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    return torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item()


STRENGTH_TOP_K = 64  # per position, the reference's most likely tokens carry the adapter's effect


def _strength(art: torch.Tensor, art_base: torch.Tensor, ref: torch.Tensor, ref_base: torch.Tensor) -> float:
    """How strongly the artifact's adapter acts, relative to PEFT's: the least-squares slope of its
    log-probability delta on the reference's (1.0: the same strength), over the reference's top tokens."""
    def lp(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.double(), -1)

    top = torch.topk(ref, min(STRENGTH_TOP_K, ref.shape[-1]), dim=-1).indices
    d_art = (lp(art) - lp(art_base)).gather(-1, top)
    d_ref = (lp(ref) - lp(ref_base)).gather(-1, top)
    return float((d_art * d_ref).sum() / (d_ref * d_ref).sum().clamp_min(1e-30))


def verify(options: VerifyOptions | None = None, /, **fields) -> VerifyReport:
    """Run the artifact in its engine against the fp32 reference; the report says which gates passed."""
    opts = coerce_options(VerifyOptions, options, fields)
    gates = parse_gates(opts.gates, opts.default_gates)
    if opts.tokens < 8:
        raise UserError(f"--tokens {opts.tokens} is too few", "compare on at least 8 tokens")
    if opts.lora is not None and opts.adapter is None:
        raise UserError("--lora needs --adapter", "pass the PEFT adapter the GGUF LoRA was made from")
    runner_cls = _runner_for(opts)
    # the engine and the artifact are checked before the reference's fp32 run (minutes on a big model)
    engine_options = getattr(runner_cls, "engine_options", ())
    if opts.gpu_layers is not None and "gpu_layers" not in engine_options:
        raise UserError(f"--gpu-layers applies to GGUF files (llama.cpp), not to {runner_cls.engine}'s artifacts",
                        "drop --gpu-layers")
    runner = runner_cls(Path(opts.artifact), Path(opts.lora) if opts.lora else None,
                        n_ctx=max(64, opts.tokens + opts.greedy_tokens + 8),
                        **{k: getattr(opts, k) for k in engine_options})
    try:
        ref = reference(opts.reference, opts.adapter, opts.eval_file, opts.tokens, opts.greedy_tokens)
        if hasattr(runner, "prepare"):  # engines that answer everything in one run
            runner.vocab_size = ref.logits.shape[-1]
            runner.prepare(ref.ids, greedy_prompt(ref.ids), len(ref.greedy))
        got = runner.logits(ref.ids)
        if got.shape != ref.logits.shape:
            raise UserError(f"the artifact's logits have shape {tuple(got.shape)}, the reference's "
                            f"{tuple(ref.logits.shape)}", "verify an artifact made from this reference model")
        cmp = compare_logits(ref.logits, got)
        prompt = greedy_prompt(ref.ids)
        art_greedy = runner.greedy(prompt, len(ref.greedy))
        same = next((i for i, (a, b) in enumerate(zip(art_greedy, ref.greedy, strict=True)) if a != b),
                    len(ref.greedy))
        metrics: dict[str, float | None] = {
            "max_abs": cmp.max_abs if runner_cls.exact_logits else None, "kl": cmp.kl, "top1": cmp.top1,
            "ppl_ratio": math.exp(_nll(got, ref.ids) - _nll(ref.logits, ref.ids)),
            "greedy": same / max(1, len(ref.greedy)), "strength": None, "strength_error": None}
        if opts.lora is not None and ref.base_logits is not None:
            metrics["strength"] = _strength(got, runner.logits(ref.ids, with_lora=False), ref.logits, ref.base_logits)
            metrics["strength_error"] = abs(metrics["strength"] - 1.0)
        checks = {c.name: c.as_dict() for c in (
            tokenizer_parity(runner.tokenize, ref.tokenizer),
            chat_template_parity(runner.render_chat, ref.tokenizer),
            special_tokens_parity(runner.special_tokens(), ref.tokenizer))}
    finally:
        runner.close()
    results = [r for g in gates if (r := g.evaluate(metrics, checks)) is not None]
    return VerifyReport(artifact=str(opts.artifact), lora=str(opts.lora) if opts.lora else None,
                        reference=str(opts.reference), adapter=str(opts.adapter) if opts.adapter else None,
                        engine=runner_cls.engine, tokens=len(ref.ids), metrics=metrics, checks=checks, gates=results)


def check_passed(report: VerifyReport) -> None:
    """Raise :class:`FidelityError` (exit code 3) naming every failed gate."""
    if not report.passed:
        raise FidelityError(report.failure_line(), "the artifact does not behave like the fine-tune")


def format_report(report: VerifyReport) -> str:
    head = (f"{report.artifact}{' + ' + report.lora if report.lora else ''} in {report.engine}\n"
            f"against {report.reference}{' + ' + report.adapter if report.adapter else ''} "
            f"(transformers{' + PEFT' if report.adapter else ''}, fp32), {report.tokens} tokens\n")
    rows = [f"  {name:15} {_value(v):>10}   {METRICS.get(name, ('LoRA strength (PEFT = 1)',))[0]}"
            for name, v in report.metrics.items() if v is not None]
    rows += [f"  {name:15} {_value(c['passed']) if c['passed'] is not None else 'n/a':>10}   {c['detail']}"
             for name, c in report.checks.items()]
    gates = [f"  {'pass' if g['passed'] else 'FAIL'}  {g['gate']}" for g in report.gates]
    return head + "\n".join(rows) + "\ngates:\n" + "\n".join(gates) + f"\n{'passed' if report.passed else 'FAILED'}"
