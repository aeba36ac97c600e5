"""``tuneport``: a thin typer layer over the Python API.

Each command builds the same options object a Python user passes and calls the same function that
``tuneport.<command>`` is (defined on its floor; the ``tuneport`` package re-exports it).
Exit codes: 0 ok; 2 bad input or usage (one line on stderr that names the fix); 3 a fidelity gate failed;
1 only for bugs. ``--json`` prints one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from tuneport.convert.errors import UserError
from tuneport.convert.options import ADAPTER_MODES, DTYPES
from tuneport.convert.targets import TARGETS
from tuneport.serve.registry import ENGINES

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Merge, export, verify and serve LoRA fine-tunes for llama.cpp and vLLM.")
_state = {"log_level": None}


def _choices(name: str, values) -> type[Enum]:
    """A typer choice type from a table of the Python API (so --help lists only what works)."""
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


Target = _choices("Target", TARGETS)
AdapterMode = _choices("AdapterMode", ADAPTER_MODES)
DType = _choices("DType", DTYPES)
EngineChoice = _choices("EngineChoice", ("auto", *ENGINES))
BaseGuard = _choices("BaseGuard", ("auto", "on", "off"))
TARGET_HELP = "What to produce. " + "; ".join(f"{t.name}: {t.summary}" for t in TARGETS.values())
LogLevel = _choices("LogLevel", ("debug", "info", "warning", "error"))
GpuLayers = Annotated[str | None, typer.Option(
    "--gpu-layers", metavar="N|all", help="llama.cpp: layers kept in VRAM (default: all where the loaded llama.cpp "
    "has a GPU backend, else 0; tuneport doctor names it)")]


def emit(obj: dict, as_json: bool, human: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
    else:
        typer.echo(human)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    log_level: Annotated[LogLevel | None, typer.Option("--log-level", help="Log to stderr from this level "
                                                       "(default warning; serve logs each request at info)")] = None,
) -> None:
    level = log_level.value if log_level else "warning"
    logging.basicConfig(level=level.upper(), stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _state["log_level"] = log_level.value if log_level else None


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(metavar="PATH", help="HF model dir or hub id, PEFT adapter dir, "
                                        ".gguf file, MLX LM dir or mlx-lm adapter dir")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """What PATH is, its architecture, size and dtype, and which engines load it as is."""
    from .inspect import format_report, inspect_path

    report = inspect_path(path)
    emit(report, as_json, format_report(report))


def _export_summary(result) -> str:
    if result.details.get("dry_run"):
        return f"would write {result.target} to {result.out}:" + "".join(f"\n  {n}" for n in result.notes)
    human = f"wrote {result.target} to {result.out}"
    for name, fixes in result.fixes.items():
        human += "".join(f"\n  {name}: fixed: {f}" for f in fixes)
    human += "".join(f"\n  note: {n}" for n in result.notes)
    return human + "".join(f"\n  warning: {w}" for w in result.warnings)


@app.command()
def merge(
    base: Annotated[str, typer.Option("--base", help="HF model dir or hub id")],
    adapter: Annotated[list[str], typer.Option("--adapter", help="PEFT adapter dir or hub id, PATH[:WEIGHT]; "
                                               "repeatable")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (written atomically)")],
    dtype: Annotated[DType, typer.Option("--dtype", help="Output dtype; auto keeps the base's")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Load *.bin/*.pt (weights_only)")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Merge adapters into the base: a complete HF directory with manifest.json."""
    from tuneport.convert.export import merge as run
    from tuneport.convert.options import MergeOptions

    from .progress import byte_progress

    opts = MergeOptions(base=base, adapters=adapter, out=out, dtype=DType(dtype).value, force=force,
                        allow_pickle=allow_pickle)
    with byte_progress("merging", not as_json) as progress:
        result = run(opts, progress=progress)
    emit(result.to_dict(), as_json, _export_summary(result))


@app.command()
def export(
    base: Annotated[str, typer.Option("--base", help="HF model dir or hub id")],
    target: Annotated[Target, typer.Option("--target", help=TARGET_HELP)],
    out: Annotated[Path, typer.Option("--out", help="Output directory (written atomically)")],
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help="[NAME=]PATH[:WEIGHT]; repeatable")] = None,
    adapters: Annotated[AdapterMode, typer.Option("--adapters", help="Merge adapters or keep them separate")]
    = "merge",
    quant: Annotated[str | None, typer.Option("--quant", help="gguf: type(s), comma-separated; mlx: one type "
                                                                      "(q4, q8, mxfp4, mixed_3_6, ...)")] = None,
    dtype: Annotated[DType, typer.Option("--dtype", help="safetensors, vllm, awq, mlx: output dtype")] = "auto",
    max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank", help="vllm: rank limit to check")] = None,
    bpe_pre: Annotated[str | None, typer.Option("--bpe-pre", help="gguf: llama.cpp pre-tokenizer name")] = None,
    name: Annotated[str | None, typer.Option("--name", help="gguf: file name stem (default: base dir name)")] = None,
    quant_format: Annotated[str | None, typer.Option("--format", help="awq: compressed-tensors (default) or "
                                                     "awq-gemm")] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="awq: 32, 64 or 128 (default); "
                                                                             "mlx: 32, 64 (default) or 128")] = None,
    symmetric: Annotated[bool, typer.Option("--symmetric", help="awq: no zero points")] = False,
    ignore: Annotated[list[str] | None, typer.Option("--ignore", help="awq: REGEX of modules kept 16-bit; "
                                                     "repeatable")] = None,
    calib: Annotated[Path | None, typer.Option("--calib", help="awq, gguf (importance matrix): calibration "
                                               "text, plain or .jsonl (awq default: built in)")] = None,
    calib_samples: Annotated[int | None, typer.Option("--calib-samples", help="awq, gguf: samples (128)")] = None,
    calib_seqlen: Annotated[int | None, typer.Option("--calib-seqlen", help="awq, gguf: tokens each (512)")] = None,
    bits: Annotated[float | None, typer.Option("--bits", help="exl3: average bits per weight, 1-8 (4.0)")] = None,
    head_bits: Annotated[float | None, typer.Option("--head-bits", help="exl3: output head bits, 1-8 or 16 (6); "
                                                    "1.5, 2.5, 3.5 with mul1")] = None,
    codebook: Annotated[str | None, typer.Option("--codebook", help="exl3: mul1 (default), mcg or 3inst")] = None,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="exl3: merged input and the converter's "
                                                  "resumable job (default OUT.exl3-work)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="exl3: print the plan and the converter command, "
                                          "write nothing")] = False,
    accept_config_key: Annotated[list[str] | None, typer.Option(
        "--accept-config-key", help="gguf, mlx: export although the config audit refuses KEY (recorded in the "
        "manifest as an accepted risk); repeatable")] = None,
    accept_tokenizer_difference: Annotated[bool, typer.Option(
        "--accept-tokenizer-difference", help="gguf: write the file although llama.cpp tokenizes some strings or "
        "chats differently from the HF tokenizer (recorded in the manifest)")] = False,
    force: Annotated[bool, typer.Option("--force")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Export for an engine (see --target); each target refuses the options it does not honour."""
    from tuneport.convert.export import export as run
    from tuneport.convert.options import ExportOptions

    from .progress import byte_progress

    opts = ExportOptions(
        base=base, target=Target(target).value, out=out, adapters=adapter or [],
        adapter_mode=AdapterMode(adapters).value, quant=quant, dtype=DType(dtype).value, max_lora_rank=max_lora_rank,
        bpe_pre=bpe_pre, name=name, quant_format=quant_format, group_size=group_size, symmetric=symmetric,
        ignore=ignore or [], calib=calib, calib_samples=calib_samples, calib_seqlen=calib_seqlen, bits=bits,
        head_bits=head_bits, codebook=codebook, work_dir=work_dir, dry_run=dry_run,
        accept_config_keys=accept_config_key or [], accept_tokenizer_difference=accept_tokenizer_difference,
        force=force, allow_pickle=allow_pickle)
    with byte_progress(f"export {opts.target}", not as_json and not dry_run) as progress:
        result = run(opts, progress=progress)
    emit(result.to_dict(), as_json, _export_summary(result))


@app.command(context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    base: Annotated[str, typer.Option("--base", help="GGUF file, HF model dir, MLX dir or hub id (vLLM serves it "
                                      "as is; llama.cpp converts it once to GGUF, MLX to MLX)")],
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help="NAME=PATH: PEFT dir, GGUF LoRA, mlx-lm "
                                                      "adapter dir or hub id; repeatable")] = None,
    adapter_dir: Annotated[Path | None, typer.Option("--adapter-dir", help="Load DIR/<name> on demand")] = None,
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto picks from format, hardware, load")] = "auto",
    max_adapters: Annotated[int, typer.Option("--max-adapters", help="Adapters loaded at once")] = 8,
    no_pin: Annotated[bool, typer.Option("--no-pin", help="Start-up adapters may be evicted too")] = False,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key_file: Annotated[Path | None, typer.Option("--api-key-file", help="Require Bearer <key>")] = None,
    admin_key_file: Annotated[Path | None, typer.Option("--admin-key-file", help="The admin API (/v1/adapters) "
                                                        "needs this key, not --api-key-file's")] = None,
    max_tokens_limit: Annotated[int | None, typer.Option("--max-tokens-limit", min=1, help="Refuse (400) "
                                                         "max_tokens above N")] = None,
    max_prompt_tokens: Annotated[int | None, typer.Option("--max-prompt-tokens", min=1, help="llama.cpp, MLX: "
                                                          "refuse (400) prompts over N tokens")] = None,
    max_concurrent_per_key: Annotated[int | None, typer.Option("--max-concurrent-per-key", min=1, help="Completion "
                                                               "and chat requests in flight per key (429 above)")
                                      ] = None,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Request bodies over N bytes answer "
                                                "413, chunked ones too, counted as they arrive")] = 1 << 20,
    body_timeout: Annotated[float, typer.Option("--body-timeout", help="Seconds a request body may take to arrive "
                                                "(408 after)")] = 60.0,
    max_header_bytes: Annotated[int, typer.Option("--max-header-bytes", help="Request line and headers over "
                                                  "N bytes answer 431")] = 32 << 10,
    header_timeout: Annotated[float, typer.Option("--header-timeout", help="Seconds a new connection may take to "
                                                  "send its request headers")] = 10.0,
    idle_timeout: Annotated[float, typer.Option("--idle-timeout", help="Seconds a connection may wait after an "
                                                "answer before its next request")] = 5.0,
    send_timeout: Annotated[float, typer.Option("--send-timeout", help="Seconds a client may read nothing of its "
                                                "answer before it is disconnected")] = 60.0,
    max_connections: Annotated[int, typer.Option("--max-connections", help="Connections held open; past it "
                                                 "the longest-idle ones are closed")] = 1024,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Expected simultaneous requests "
                                             "(engine choice and memory plan)")] = 8,
    dtype: Annotated[DType, typer.Option("--dtype", help="vLLM: model dtype; llama.cpp: the GGUF an HF base is "
                                         "converted to (auto: F16); MLX: the MLX model it is converted to")] = "auto",
    n_ctx: Annotated[int, typer.Option("--n-ctx", help="llama.cpp, MLX: context length per sequence")] = 2048,
    contexts: Annotated[int, typer.Option("--contexts", min=1, help="llama.cpp: the most contexts the decode loop "
                                          "creates, one per adapter set under mixed traffic (each n_ctx × 8 KV "
                                          "cells; spares re-planning the graph at each adapter switch)")] = 1,
    max_sets_per_batch: Annotated[int | None, typer.Option("--max-sets-per-batch", min=1, help="llama.cpp with "
                                                           "per-sequence LoRA: distinct adapter sets decoded in one "
                                                           "batch, others wait (default 8)")] = None,
    no_prompt_cache: Annotated[bool, typer.Option("--no-prompt-cache", help="llama.cpp: keep no finished "
                                                  "prompts' KV cells for reuse")] = False,
    kv_f32: Annotated[bool, typer.Option("--kv-f32", help="llama.cpp: F32 KV cache (fp32 parity, 2x memory)")] = False,
    gpu_layers: GpuLayers = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="vLLM: context length")] = None,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", help="vLLM: GPUs per layer")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option("--pipeline-parallel-size", help="vLLM: stages")] = 1,
    max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank", help="vLLM: default the largest "
                                                      "adapter rank, rounded up")] = None,
    max_loras: Annotated[int | None, typer.Option("--max-loras", help="vLLM: adapters in one batch "
                                                  "(default --max-adapters)")] = None,
    engine_port: Annotated[int | None, typer.Option("--engine-port", help="vLLM's own port on 127.0.0.1 "
                                                    "(default --port + 1)")] = None,
    base_guard: Annotated[BaseGuard, typer.Option("--vllm-base-guard", help="vLLM: send base traffic as a zero "
                                                  "adapter (auto: where the vLLM CPU bug applies)")] = "auto",
    log_file: Annotated[Path | None, typer.Option("--log-file", help="vLLM's log (default in the cache)")] = None,
    tabby_dir: Annotated[Path | None, typer.Option("--tabby-dir", help="exllamav3: a TabbyAPI checkout to run "
                                                   "(its main.py; AGPL, not shipped with tuneport)")] = None,
    restart_engine: Annotated[bool, typer.Option("--restart-engine", help="vLLM: start it again when it dies "
                                                 "(else serve exits 1 with vLLM's error)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the engine, memory plan and command")] = False,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="llama.cpp: threads (default: the "
                                                "physical cores; on Ray: --cpus-per-replica)")] = None,
    on: Annotated[str, typer.Option("--on", help="local: one server here; ray: replicas on Ray Serve, each "
                                    "request routed to a replica holding its adapter")] = "local",
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="--on ray: a running cluster (auto, "
                                                    "ray://HOST:10001); default: start one here")] = None,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="--on ray: replicas; --dry-run without Ray: "
                                          "commands for N replicas behind nginx")] = 1,
    min_replicas: Annotated[int | None, typer.Option("--min-replicas", help="--on ray: autoscale from N")] = None,
    max_replicas: Annotated[int | None, typer.Option("--max-replicas", help="--on ray: autoscale up to N")] = None,
    target_ongoing_requests: Annotated[float, typer.Option("--target-ongoing-requests", help="--on ray: requests "
                                                           "in flight per replica autoscaling aims for")] = 2.0,
    upscale_delay: Annotated[float, typer.Option("--upscale-delay", help="--on ray: seconds above target before "
                                                 "adding a replica")] = 10.0,
    downscale_delay: Annotated[float, typer.Option("--downscale-delay", help="--on ray: seconds below target "
                                                   "before removing one")] = 60.0,
    cpus_per_replica: Annotated[float, typer.Option("--cpus-per-replica", help="--on ray: CPUs each replica "
                                                    "reserves")] = 1.0,
    gpus_per_replica: Annotated[float | None, typer.Option("--gpus-per-replica", help="--on ray: GPUs each "
                                                           "replica reserves (default 0); nginx dry run: 1")] = None,
    deploy_dir: Annotated[Path | None, typer.Option("--deploy-dir", help="--dry-run --on ray: where the Serve "
                                                    "config and KubeRay manifest go (./tuneport-ray)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="--dry-run: one JSON object")] = False,
) -> None:
    """Serve the base and many adapters over one OpenAI-compatible API (llama.cpp, vLLM, MLX; ExLlamaV3 serves one
    merged EXL3).

    Flags after `--` go to vLLM as they are (e.g. `-- --gpu-memory-utilization 0.85`)."""
    from tuneport.serve.options import ServeOptions
    from tuneport.serve.server import plan, serve_forever

    opts = ServeOptions(
        base=base, adapters=adapter or [], adapter_dir=adapter_dir, engine=EngineChoice(engine).value,
        max_adapters=max_adapters, pin=not no_pin, host=host, port=port, api_key_file=api_key_file,
        admin_key_file=admin_key_file, max_tokens_limit=max_tokens_limit, max_prompt_tokens=max_prompt_tokens,
        max_concurrent_per_key=max_concurrent_per_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout,
        max_header_bytes=max_header_bytes, header_timeout_s=header_timeout, idle_timeout_s=idle_timeout,
        send_timeout_s=send_timeout, max_connections=max_connections, concurrency=concurrency,
        dtype=DType(dtype).value, n_ctx=n_ctx, contexts=contexts, kv_f32=kv_f32,
        max_sets_per_batch=max_sets_per_batch, prompt_cache=not no_prompt_cache, gpu_layers=gpu_layers,
        max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size, max_lora_rank=max_lora_rank, max_loras=max_loras,
        engine_port=engine_port, vllm_base_guard=BaseGuard(base_guard).value, log_file=log_file,
        restart_engine=restart_engine, tabby_dir=tabby_dir, vllm_args=list(ctx.args), threads=threads, on=on,
        ray_address=ray_address, replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
        target_ongoing_requests=target_ongoing_requests, upscale_delay_s=upscale_delay,
        downscale_delay_s=downscale_delay, cpus_per_replica=cpus_per_replica, gpus_per_replica=gpus_per_replica,
        deploy_dir=deploy_dir)
    if dry_run:
        from tuneport.serve.policy import format_dry_run

        report = plan(opts)
        emit(report, as_json, format_dry_run(report))
        return
    if as_json:
        raise UserError("--json applies to --dry-run", "drop --json, or add --dry-run")
    if _state["log_level"] is None:  # by default a server logs every request
        logging.getLogger("tuneport.access").setLevel(logging.INFO)
        logging.getLogger("tuneport.serve").setLevel(logging.INFO)
    serve_forever(opts)


@app.command()
def verify(
    artifact: Annotated[Path, typer.Argument(metavar="ARTIFACT", help="The artifact to verify: a .gguf model file, "
                                             "a tuneport vLLM bundle or a merged HF model directory")],
    reference: Annotated[str, typer.Option("--reference", help="The fine-tune's base: HF dir or hub id")],
    adapter: Annotated[str | None, typer.Option("--adapter", help="The fine-tune's PEFT adapter (reference = "
                                                "base + adapter)")] = None,
    lora: Annotated[Path | None, typer.Option("--lora", help="A LoRA to run on ARTIFACT: a GGUF LoRA file (GGUF) "
                                              "or a PEFT dir (vLLM); its strength is checked against --adapter")
                    ] = None,
    eval_file: Annotated[Path | None, typer.Option("--eval", help="Text to compare on (default: a built-in "
                                                   "offline corpus)")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Eval tokens")] = 256,
    gate: Annotated[list[str] | None, typer.Option("--gate", help="METRIC<=X, METRIC>=X or a check name; "
                                                   "repeatable; exit 3 when one fails")] = None,
    no_default_gates: Annotated[bool, typer.Option("--no-default-gates", help="Only the --gate given")] = False,
    gpu_layers: GpuLayers = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Run ARTIFACT in its own engine against the fp32 fine-tune: KL, top-1, perplexity ratio, greedy
    agreement, LoRA strength, tokenizer / chat template / special token parity; exit 3 when a gate fails."""
    from .verify import VerifyOptions, check_passed, format_report
    from .verify import verify as run_verify

    report = run_verify(VerifyOptions(artifact=artifact, reference=reference, adapter=adapter, lora=lora,
                                      eval_file=eval_file, tokens=tokens, gates=list(gate or []),
                                      default_gates=not no_default_gates, gpu_layers=gpu_layers))
    emit(report.to_dict(), as_json, format_report(report))
    check_passed(report)


@app.command()
def release(
    recipe: Annotated[Path, typer.Argument(metavar="RECIPE", help="The release recipe (YAML)")],
    out: Annotated[Path | None, typer.Option("--out", help="The release directory (default: "
                                             "release-NAME-VERSION)")] = None,
    push: Annotated[bool, typer.Option("--push", help="Upload to the recipe's publish.repo")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --push: print the upload, touch no "
                                          "network")] = False,
    gpu_layers: GpuLayers = None,
    as_json: Annotated[bool, typer.Option("--json", help="The summary on stdout (progress on stderr)")] = False,
) -> None:
    """Export every target of RECIPE, verify each artifact in its engine against the fine-tune, apply the
    gates (exit 3, nothing published) and write the release directory: artifacts, manifest, model card."""
    from .progress import stdout
    from .release import ReleaseOptions
    from .release import release as run_release

    if as_json:
        stdout.file = sys.stderr
    try:
        summary = run_release(ReleaseOptions(recipe=recipe, out=out, push=push, dry_run=dry_run,
                                                    gpu_layers=gpu_layers))
    finally:
        stdout.file = None
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
        return
    stdout.print(f"release written to {summary['out']}: {len(summary['artifacts'])} artifacts, all gates passed",
                 soft_wrap=True)
    for line in (summary.get("publish") or {}).get("operations", []):
        stdout.print(("would " if summary["publish"]["dry_run"] else "did ") + line, soft_wrap=True)
    for f in (summary.get("publish") or {}).get("files", []):
        stdout.print(f"  {f['path']}  {f['bytes']} bytes  sha256 {f['sha256']}  {'LFS' if f['lfs'] else 'git'}",
                     soft_wrap=True)


@app.command()
def doctor(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Python, torch, which engines are importable, CUDA, versions, and whether mlx runs here (and on what)."""
    from .doctor import doctor_report, format_doctor

    report = doctor_report()
    emit(report, as_json, format_doctor(report))


@app.command("llama-wheel")
def llama_wheel(
    install: Annotated[bool, typer.Option("--install", help="pip-install it into this Python, with its "
                                          "dependencies")] = False,
    wheel_dir: Annotated[Path | None, typer.Option("--wheel-dir", help="Where wheels are cached "
                                                   "[default: ~/.cache/tuneport/wheels]")] = None,
    cmake_args: Annotated[str | None, typer.Option("--cmake-args", help="llama.cpp's CMake options [default: "
                                                   "$CMAKE_ARGS, else portable x86 CPU flags]")] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Build even if the cache holds the wheel")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Build llama-cpp-python 0.3.36 with tuneport's llama.cpp patches (per-sequence LoRA: serve --engine llamacpp
    decodes requests for different adapters in one batch); e.g. CMAKE_ARGS=-DGGML_CUDA=on for CUDA."""
    from .llama_wheel import LlamaWheelOptions, build_llama_wheel

    opts = LlamaWheelOptions(install=install, rebuild=rebuild)
    if wheel_dir is not None:
        opts.wheel_dir = wheel_dir
    if cmake_args is not None:
        opts.cmake_args = cmake_args
    if not as_json:
        logging.getLogger("tuneport.toolkit.llama_wheel").setLevel(logging.INFO)  # its progress on stderr
    report = build_llama_wheel(opts)
    emit(report, as_json, f"llama-cpp-python {report['version']}: {report['wheel']}"
         + (" (installed)" if report["installed"] else f"\n  install: pip install {report['wheel']}"))


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Where the demo writes (its earlier output is replaced)")
                   ] = Path("demo-out"),
    tiny: Annotated[bool, typer.Option("--tiny", help="The fast offline demo on generated tiny models")] = False,
    gpu_layers: GpuLayers = None,
    as_json: Annotated[bool, typer.Option("--json", help="The demo's report on stdout (its story on stderr)")] = False,
) -> None:
    """SmolLM2-135M-Instruct from the package index and two LoRAs trained on the spot: merge, export GGUF and
    vLLM, measure each file in llama.cpp, serve all three through the gateway (--tiny: offline, tiny models)."""
    from .demo import DemoOptions, run_demo
    from .progress import stdout

    if not as_json:
        run_demo(DemoOptions(out=out, tiny=tiny, gpu_layers=gpu_layers))
        return
    stdout.file = sys.stderr  # the story on stderr, the report alone on stdout
    try:
        report = run_demo(DemoOptions(out=out, tiny=tiny, gpu_layers=gpu_layers))
    finally:
        stdout.file = None  # back to sys.stdout
    sys.stdout.write(json.dumps(report, default=str) + "\n")


def _is_usage_error(e: BaseException) -> bool:
    """click's (or typer's vendored click's) own errors: unknown option, bad choice, missing option."""
    return any(c.__name__ == "ClickException" for c in type(e).__mro__) and hasattr(e, "show")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: UserError -> one line on stderr and its exit code; usage errors -> the usage
    line and the problem, exit 2; bugs -> exit 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        app(argv, prog_name="tuneport", standalone_mode=False)
        return 0
    except UserError as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"error: {e.line()}\n")
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("aborted\n")
        return 130
    except Exception as e:
        if _is_usage_error(e):
            e.show(file=sys.stderr)
            return int(getattr(e, "exit_code", 2) or 2)
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
