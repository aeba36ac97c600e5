"""The release's ``README.md``: a Hugging Face model card (YAML front matter the hub reads), the measured
metrics of every artifact, and how to run each with llama.cpp, Ollama, vLLM and ``tuneport serve``."""

from __future__ import annotations

from pathlib import Path

from tuneport.convert import __version__

from .recipe import Recipe


def _front_matter(recipe: Recipe, artifacts: list[dict]) -> str:
    import yaml

    kinds = sorted({a["target"].split("-")[0] for a in artifacts})
    meta = {"base_model": recipe.base.path if "/" in recipe.base.path and not recipe.base.path.startswith((".", "/"))
            else None, "library_name": "gguf" if "gguf" in kinds else "mlx" if kinds == ["mlx"] else "transformers",
            "license": recipe.license, "tags": ["tuneport", "lora", *kinds]}
    return "---\n" + yaml.safe_dump({k: v for k, v in meta.items() if v is not None}, sort_keys=False) + "---\n"


def _metric(a: dict, key: str, fmt: str) -> str:
    v = (a.get("metrics") or {}).get(key)
    return format(v, fmt) if v is not None else "–"


def _usage(out: Path, artifacts: list[dict]) -> list[str]:
    lines = []
    ggufs = [a for a in artifacts if a.get("quant")]
    if ggufs:
        model = next(a for a in ggufs if not a["lora"])["path"]
        lora = next((a["lora"] for a in ggufs if a["lora"]), None)
        lines += ["llama.cpp:", "```bash", f"llama-cli -m {model}" + (f" --lora {lora}" if lora else ""), "```"]
        modelfiles = sorted(p.relative_to(out).as_posix() for p in out.glob("artifacts/gguf-*/Modelfile*"))
        if modelfiles:
            lines += ["Ollama:", "```bash", f"cd {Path(modelfiles[-1]).parent} && ollama create my-model -f "
                      f"{Path(modelfiles[-1]).name}", "```"]
        lines += ["tuneport (one OpenAI-compatible server, adapters picked per request):", "```bash",
                  f"tuneport serve --base {model}" + "".join(
                      f" --adapter {a['adapter']}={a['lora']}" for a in ggufs if a["lora"] and a["path"] == model),
                  "```"]
    for target in dict.fromkeys(a["target"] for a in artifacts if a["target"].startswith("vllm")):
        lines += ["vLLM:", "```bash", f"artifacts/{target}/serve-vllm.sh --port 8000", "```"]
    for target in dict.fromkeys(a["target"] for a in artifacts if a["target"].startswith("mlx")):
        lora = next((a["lora"] for a in artifacts if a["target"] == target and a["lora"]), None)
        lines += ["MLX (mlx-lm):", "```bash", f"python -m mlx_lm generate --model artifacts/{target}"
                  + (f" --adapter-path {lora}" if lora else "") + " --prompt 'Hello'",
                  f"artifacts/{target}/serve-mlx.sh --port 8080", "```"]
    return lines


def _accepted_risks(out: Path) -> list[str]:
    """What the config audit would have refused and the recipe accepted (accept_config_keys), per target."""
    import json

    lines = []
    for manifest in sorted(out.glob("artifacts/*/manifest.json")):
        notes = json.loads(manifest.read_text()).get("options", {}).get("notes", [])
        lines += [f"- `{manifest.parent.name}`: {n.split(': ', 1)[1]}" for n in notes
                  if n.startswith("accepted risk")]
    if not lines:
        return []
    return ["## Accepted risks", "", "The recipe accepted these config keys, which tuneport's audit refuses because "
            "the engine may compute differently from transformers:", "", *lines, ""]


def model_card(recipe: Recipe, artifacts: list[dict], out: Path) -> str:
    rows = ["| artifact | engine | MB | KL vs fp32 | top-1 | ppl ratio | max \\|Δlogit\\| | LoRA strength | gates |",
            "|---|---|---|---|---|---|---|---|---|"]
    for a in artifacts:
        name = a["path"] + (f" + {Path(a['lora']).name}" if a.get("lora") else "")
        gates = a.get("not_measured") or ("passed" if a["passed"] else "FAILED")
        mb = f"{a['bytes'] / 1e6:.1f}" if a.get("bytes") else "–"
        rows.append(f"| {name} | {a.get('engine', '–')} | {mb} | {_metric(a, 'kl', '.2e')} | "
                    f"{_metric(a, 'top1', '.1%')} | {_metric(a, 'ppl_ratio', '.4f')} | "
                    f"{_metric(a, 'max_abs', '.3g')} | {_metric(a, 'strength', '.3f')} | {gates} |")
    adapters = ", ".join(f"`{a.name}`" for a in recipe.adapters) or "none"
    return "\n".join([
        _front_matter(recipe, artifacts),
        f"# {recipe.name} {recipe.version}",
        "",
        f"Base: `{recipe.base.path}`{f' (revision {recipe.base.revision})' if recipe.base.revision else ''}; "
        f"LoRA adapters: {adapters}. Released with tuneport {__version__} from `recipe.yaml`; every file, with "
        "its sha256, is in `manifest.json`.",
        "",
        "## Fidelity",
        "",
        "Each artifact ran in its own engine (GGUF files in llama.cpp with an F32 KV cache; the vLLM bundle and "
        "merged models in vLLM, fp32; MLX directories in mlx-lm) against the fine-tune in transformers + PEFT (fp32), "
        f"on {max((a.get('tokens') or 0 for a in artifacts), default=recipe.eval.tokens)} tokens of evaluation "
        "text; tokenizer, chat template and special tokens were "
        "checked against the HF tokenizer.",
        "",
        *rows,
        "",
        *(["![file size against KL per quant type](fidelity.png)", ""] if (out / "fidelity.png").exists() else []),
        *_accepted_risks(out),
        "## Run it",
        "",
        *_usage(out, artifacts),
        "",
    ])
