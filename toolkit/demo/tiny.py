"""``tuneport demo --tiny``: the main job end to end on a built-in tiny model, offline, in a few seconds.

Builds a tiny llama base and two PEFT adapters, merges one (and checks the merged model against PEFT),
exports the other for vLLM as base + adapter, exports the base to GGUF Q8_0 with both adapters as GGUF
LoRAs and Ollama Modelfiles (and runs them in llama.cpp), serves the base with both adapters through
tuneport's gateway (one request per adapter), and prints ``inspect`` for each.
"""

from __future__ import annotations

from pathlib import Path

from tuneport.convert.export import export, merge
from tuneport.convert.export_vllm import LAUNCH_SH
from tuneport.serve.server import serve

from ..inspect import format_report, inspect_path
from ..progress import stdout

console = stdout


def run_tiny_demo(out: Path, gpu_layers: int | str | None = None) -> dict:
    """The tiny demo into ``out`` (a new or empty directory)."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..fidelity import compare_logits, load_hf, load_peft, logits
    from ..tiny import TinyZoo

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    out = Path(out)
    zoo = TinyZoo(out / "models")
    console.rule("[bold]1. a tiny base model and two LoRA adapters (made with PEFT)")
    base = zoo.base("llama")
    chat = zoo.adapter("llama", "all_linear")
    style = zoo.adapter("llama", "rslora")
    console.print(f"base     {base}\nadapter  {chat}  (all-linear, r=8)\nadapter  {style}  (rsLoRA, r=16)")

    console.rule("[bold]2. tuneport merge: base + all-linear adapter -> one HF model")
    merged = out / "merged"
    merge(base=base, adapters=[chat], out=merged)
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 200, 300, 411]])
    cmp = compare_logits(logits(load_peft(base, chat), ids), logits(load_hf(merged), ids))
    console.print(f"wrote {merged}\nfidelity vs PEFT (fp32): max |Δlogit| = {cmp.max_abs:.2e}, "
                  f"KL = {cmp.kl:.2e}, top-1 agreement = {cmp.top1:.0%}")

    console.rule("[bold]3. tuneport export --target vllm --adapters separate: base + rsLoRA adapter")
    bundle = out / "vllm-bundle"
    result = export(base=base, adapters=[f"style={style}"], target="vllm", adapter_mode="separate",
                             out=bundle)
    console.print(f"wrote {bundle}; serve it with {bundle / LAUNCH_SH}")
    for name, fixes in result.fixes.items():
        for f in fixes:
            console.print(f"  {name}: fixed: {f}")

    console.rule("[bold]4. tuneport export --target gguf --quant q8_0 --adapters separate (llama.cpp, Ollama)")
    gguf_dir = out / "gguf"
    gm = export(base=base, adapters=[f"chat={chat}", f"style={style}"], target="gguf",
                         adapter_mode="separate", quant="q8_0", out=gguf_dir).details
    model_file = gguf_dir / gm["models"]["q8_0"]
    console.print(f"wrote {model_file.name}, " + ", ".join(gm["loras"].values())
                  + ", Modelfile, Modelfile.chat, Modelfile.style")
    gguf_fidelity = {}
    try:
        from tuneport.convert.gguf.gpu import n_gpu_layers

        from ..fidelity import llamacpp_logits, llamacpp_model

        for name, rel in gm["loras"].items():
            llm = llamacpp_model(model_file, gguf_dir / rel, n_gpu_layers=n_gpu_layers(gpu_layers))
            try:
                got = llamacpp_logits(llm, ids[0].tolist())
            finally:
                llm.close()
            ref = logits(load_peft(base, chat if name == "chat" else style), ids)[0]
            gguf_fidelity[name] = compare_logits(ref, got).as_dict()
            console.print(f"llama.cpp Q8_0 + {rel} vs PEFT (fp32): KL = {gguf_fidelity[name]['kl']:.2e}, "
                          f"top-1 agreement = {gguf_fidelity[name]['top1']:.0%}")
    except ImportError:
        console.print("llama-cpp-python is not installed: skipped running the GGUF files")

    served = {}
    try:
        served = _serve_demo(model_file, gguf_dir, gm["loras"], gpu_layers)
    except ImportError:
        console.print("llama-cpp-python is not installed: skipped serving")

    console.rule("[bold]6. tuneport inspect")
    for path in (base, chat, style, merged, bundle / "adapters" / "style", model_file,
                 gguf_dir / gm["loras"]["style"]):
        console.print(format_report(inspect_path(path)), markup=False, highlight=False, soft_wrap=True)
        console.print()
    return {"base": str(base), "merged": str(merged), "bundle": str(bundle), "gguf": str(gguf_dir),
            "fidelity": cmp.as_dict(), "gguf_fidelity": gguf_fidelity, "served": served}


def _serve_demo(model_file: Path, gguf_dir: Path, loras: dict[str, str], gpu_layers: int | str | None = None
                ) -> dict[str, str]:
    """Serve the GGUF base with both LoRAs (what tuneport serve runs) and ask each the same question."""
    import httpx

    console.rule("[bold]5. tuneport serve --engine llamacpp: one base, adapters picked per request")
    answers = {}
    with serve(base=model_file, adapters={n: gguf_dir / p for n, p in loras.items()}, engine="llamacpp",
                        max_adapters=4, n_ctx=128, contexts=1, gpu_layers=gpu_layers, port=0) as server:
        for model in [server.backend.name, *loras]:
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": model, "prompt": "The model merges", "max_tokens": 12, "temperature": 0})
            answers[model] = r.json()["choices"][0]["text"]
            console.print(f"model={model!r:22} -> {answers[model]!r}", markup=False, highlight=False)
    return answers
