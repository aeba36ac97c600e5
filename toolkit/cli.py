"""``tuneport``: a thin typer layer over the Python API in ``convert`` and ``toolkit``.

Exit codes: 0 ok; 2 bad input (one line on stderr that names the fix); 3 a fidelity gate failed;
1 only for bugs. ``--json`` prints one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import json
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from convert.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Merge, export, verify and serve LoRA fine-tunes for llama.cpp, vLLM and ExLlamaV3.")
_state = {"debug": False}


class Target(str, Enum):
    safetensors = "safetensors"
    vllm = "vllm"
    gguf = "gguf"
    awq = "awq"
    exl3 = "exl3"


class AdapterMode(str, Enum):
    merge = "merge"
    separate = "separate"


class DType(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def emit(obj: dict, as_json: bool, human: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
    else:
        typer.echo(human)


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False) -> None:
    _state["debug"] = debug


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="HF model dir or hub id, PEFT adapter dir, or .gguf file")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """What PATH is, its architecture, size and dtype, and which engines load it as is."""
    from toolkit.inspect import format_report, inspect_path

    report = inspect_path(path)
    emit(report, as_json, format_report(report))


@app.command()
def merge(
    base: Annotated[str, typer.Option("--base", help="HF model dir or hub id")],
    adapter: Annotated[list[str], typer.Option("--adapter", help="PEFT adapter dir, PATH[:WEIGHT]; repeatable")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (written atomically)")],
    dtype: Annotated[DType, typer.Option("--dtype", help="Output dtype; auto keeps the base's")] = DType.auto,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Load *.bin/*.pt (weights_only)")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Merge adapters into the base: a complete HF directory with manifest.json."""
    from convert.export_hf import AdapterArg, merge_to_dir
    from toolkit.progress import byte_progress

    with byte_progress("merging", not as_json) as progress:
        result = merge_to_dir(base, [AdapterArg.parse(a) for a in adapter], out, dtype.value, force,
                              allow_pickle, progress=progress)
    summary = {"out": str(result.out), "target": "merge", "notes": result.plan.notes,
               "config_updates": result.plan.config_updates, "outputs": result.manifest["outputs"]}
    emit(summary, as_json, f"merged {len(adapter)} adapter(s) into {result.out}"
         + "".join(f"\n  note: {n}" for n in result.plan.notes))


@app.command()
def export(
    base: Annotated[str, typer.Option("--base", help="HF model dir or hub id")],
    target: Annotated[Target, typer.Option("--target", help="What to produce")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (written atomically)")],
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help="[NAME=]PATH[:WEIGHT]; repeatable")] = None,
    adapters: Annotated[AdapterMode, typer.Option("--adapters", help="Merge adapters or keep them separate")]
    = AdapterMode.merge,
    quant: Annotated[str | None, typer.Option("--quant", help="Quantization type(s), comma-separated")] = None,
    dtype: Annotated[DType, typer.Option("--dtype")] = DType.auto,
    max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank", help="vLLM rank limit to check")] = None,
    bpe_pre: Annotated[str | None, typer.Option("--bpe-pre", help="GGUF: llama.cpp pre-tokenizer name")] = None,
    name: Annotated[str | None, typer.Option("--name", help="GGUF: file name stem (default: base dir name)")] = None,
    force: Annotated[bool, typer.Option("--force")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Export for an engine: safetensors (merged HF dir), vllm (merged, or base + vLLM-ready adapters),
    gguf (llama.cpp model per --quant type, GGUF LoRAs with --adapters separate, Ollama Modelfiles)."""
    from convert.export_hf import AdapterArg, merge_to_dir
    from convert.export_vllm import LAUNCH_SH, export_vllm
    from toolkit.progress import byte_progress

    args = [AdapterArg.parse(a) for a in adapter or []]
    if (bpe_pre or name) and target is not Target.gguf:
        raise UserError("--bpe-pre and --name apply to --target gguf only", "drop them")
    if quant and target in (Target.safetensors, Target.vllm):
        raise UserError(f"--quant does not apply to --target {target.value}", "drop --quant, or use --target gguf")
    with byte_progress(f"export {target.value}", not as_json) as progress:
        if target is Target.safetensors:
            if adapters is AdapterMode.separate:
                raise UserError("--target safetensors writes one merged model",
                                "use --adapters merge, or --target vllm --adapters separate")
            manifest = merge_to_dir(base, args, out, dtype.value, force, allow_pickle, progress=progress,
                                    target="safetensors").manifest
        elif target is Target.vllm:
            manifest = export_vllm(base, args, out, adapters.value, dtype.value, force, allow_pickle, progress,
                                   max_lora_rank)
        elif target is Target.gguf:
            from convert.gguf.export import export_gguf

            manifest = export_gguf(base, args, out, adapters.value, quant, bpe_pre, name, force, allow_pickle,
                                   progress)
        else:
            raise UserError(f"--target {target.value} is not available in this version of tuneport",
                            "available targets: safetensors, vllm, gguf")
    fixes = manifest.get("fixes", {})
    human = f"exported {target.value} ({adapters.value}) to {out}"
    for name, fx in fixes.items():
        human += "".join(f"\n  {name}: fixed: {f}" for f in fx)
    if target is Target.vllm:
        human += f"\n  serve it with: {Path(out) / LAUNCH_SH}"
    for w in manifest.get("warnings", []):
        human += f"\n  warning: {w}"
    extra = {k: manifest[k] for k in ("models", "loras", "folded_scales", "warnings") if k in manifest}
    emit({"out": str(out), "target": target.value, "adapters": adapters.value, "fixes": fixes,
          "outputs": manifest["outputs"], **extra}, as_json, human)


class EngineChoice(str, Enum):
    auto = "auto"
    llamacpp = "llamacpp"
    vllm = "vllm"
    exllamav3 = "exllamav3"


class BaseGuard(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


@app.command(context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    base: Annotated[str, typer.Option("--base", help="GGUF file, or HF model dir (vLLM serves it as is; "
                                      "llama.cpp converts it once to GGUF)")],
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help="NAME=PATH (PEFT dir or GGUF LoRA)")] = None,
    adapter_dir: Annotated[Path | None, typer.Option("--adapter-dir", help="Load DIR/<name> on demand")] = None,
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto picks from format, hardware, load")] = (
        EngineChoice.auto),
    max_adapters: Annotated[int, typer.Option("--max-adapters", help="Adapters loaded at once")] = 8,
    no_pin: Annotated[bool, typer.Option("--no-pin", help="Start-up adapters may be evicted too")] = False,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key_file: Annotated[Path | None, typer.Option("--api-key-file", help="Require Bearer <key>")] = None,
    n_ctx: Annotated[int, typer.Option("--n-ctx", help="llama.cpp: context length per worker")] = 2048,
    workers: Annotated[int, typer.Option("--workers", help="llama.cpp: parallel contexts")] = 2,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Expected simultaneous requests "
                                             "(engine choice and memory plan)")] = 8,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="vLLM: context length")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="vLLM: auto, float32, bfloat16, float16")] = None,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", help="vLLM: GPUs per layer")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option("--pipeline-parallel-size", help="vLLM: stages")] = 1,
    max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank", help="vLLM: default the largest "
                                                      "adapter rank, rounded up")] = None,
    max_loras: Annotated[int | None, typer.Option("--max-loras", help="vLLM: adapters in one batch "
                                                  "(default --max-adapters)")] = None,
    engine_port: Annotated[int | None, typer.Option("--engine-port", help="vLLM's own port on 127.0.0.1 "
                                                    "(default --port + 1)")] = None,
    base_guard: Annotated[BaseGuard, typer.Option("--vllm-base-guard", help="Send base traffic as a zero "
                                                  "adapter (auto: where the vLLM CPU bug applies)")] = BaseGuard.auto,
    log_file: Annotated[Path | None, typer.Option("--log-file", help="vLLM's log (default in the cache)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the engine, memory plan and command")] = False,
    replicas: Annotated[int, typer.Option("--replicas", help="--dry-run: commands for N replicas")] = 1,
    gpus_per_replica: Annotated[int, typer.Option("--gpus-per-replica", help="--dry-run: GPUs each")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="--dry-run: one JSON object")] = False,
) -> None:
    """Serve the base and many adapters over one OpenAI-compatible API (llama.cpp or vLLM).

    Flags after `--` go to vLLM as they are (e.g. `-- --gpu-memory-utilization 0.85`)."""
    from serve.run import ServeRequest, serve

    req = ServeRequest(
        base=base, adapters=adapter or [], adapter_dir=adapter_dir, engine=engine.value, max_adapters=max_adapters,
        pin=not no_pin, host=host, port=port, api_key_file=api_key_file, n_ctx=n_ctx, workers=workers,
        concurrency=concurrency, max_model_len=max_model_len, dtype=dtype,
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        max_lora_rank=max_lora_rank, max_loras=max_loras, engine_port=engine_port, guard=base_guard.value,
        log_file=log_file, extra_args=list(ctx.args), replicas=replicas, gpus_per_replica=gpus_per_replica)
    report = serve(req, dry_run=dry_run)
    if report is not None:
        from serve.policy import format_dry_run

        emit(report, as_json, format_dry_run(report))


@app.command()
def doctor(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Python, torch, which engines are importable, CUDA, versions."""
    from toolkit.doctor import doctor_report, format_doctor

    report = doctor_report()
    emit(report, as_json, format_doctor(report))


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Where the demo writes")] = Path("demo-out"),
    force: Annotated[bool, typer.Option("--force", help="Start over if --out exists")] = True,
) -> None:
    """Build a tiny base and two adapters, merge one, export the other for vLLM, inspect each."""
    from toolkit.demo import run_demo

    run_demo(out, force)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: UserError -> one line on stderr and its exit code; bugs -> exit 1."""
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
    except Exception as e:  # click usage errors carry their own exit code
        import click

        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
