"""ExLlamaV3 in this process: one EXL3 base, PEFT LoRA adapters placed at run time, requests of one adapter set
decoded together in exllamav3's paged, continuously batched ``Generator``.

exllamav3 (``exllamav3/model/lora.py``, ``modules/linear.py``) keeps each loaded ``LoRA``'s matrices in every target
``Linear``'s ``lora_a_tensors`` / ``lora_b_tensors`` (dicts keyed by the LoRA object) and adds all of them to every
token of every sequence in a forward. So adapters are loaded once (``LoRA.from_directory`` on the directory
:mod:`tuneport.convert.exl3.adapter` rewrote, scales baked in) and their tensors taken straight off the modules into
a stash; only the active *adapter set*'s tensors are put back, and the set changes only while the generator is
idle. Scheduling (:class:`AdapterTurns`): the set of the oldest waiting request takes the next turn; requests of
that set join the running batch while no other set waits, after which the batch drains and the next set starts.
Base requests run with no tensors registered. When the set changes, the generator's prefix cache is reset (its
pages are keyed by token ids only, and their K/V depend on the adapter).

exllamav3's fused decode paths bypass ``Linear.forward`` and with it the LoRA: the graphed decode attention
(``bc_attn``), the paired-projection MGEMMs (``multi_kv``, ``multi_qg``, ``multi_gu``) and the graphed MLPs
(``MLP.bc``, ``GatedMLP.bc``). While an adapter set is active they are switched off (:class:`FastPaths`); base
turns keep them. Sampling is exllamav3's (argmax at temperature 0, else temperature and top-p with the request's
seed); log-probabilities come from the raw logits it returns.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from tuneport.convert.errors import UserError
from tuneport.convert.exl3.tabby import round_cache

from .base import AdapterEngine, Done, Event, EventStream, GenerationRequest, Sequence
from .exllamav3_fast_paths import FastPaths
from .exllamav3_schedule import AdapterSet, AdapterTurns, adapter_set

log = logging.getLogger("tuneport.serve.exllamav3")
@dataclass(eq=False)
class _Seq(Sequence):
    key: AdapterSet = ()
    job: object = None


@dataclass
class _Loaded:
    lora: object  # exllamav3.model.lora.LoRA
    tensors: list[tuple[object, object, object]]  # (Linear, A, B) taken off the modules
    nbytes: int


class Exl3Engine(AdapterEngine):
    """The EXL3 model in ``model_dir`` served with adapters. ``n_ctx``: the most tokens (prompt + output) one
    request may use; ``cache_tokens``: the paged cache (shared by a batch); ``max_batch``: sequences together."""

    def __init__(self, model_dir: Path, *, n_ctx: int = 2048, cache_tokens: int = 16384, max_batch: int = 32) -> None:
        self.model_dir = Path(model_dir)
        self.n_ctx, self.max_batch = n_ctx, max_batch
        # one token over n_ctx: each job is given max_tokens + 1 (see _job), and exllamav3 refuses a job whose
        # prompt + max_new_tokens needs more pages than the cache has
        self.cache_tokens = round_cache(max(cache_tokens, n_ctx + 1))
        self.turns = AdapterTurns(max_batch)
        self._cv = threading.Condition()
        self._jobs: list[tuple[Callable[[], object], Future]] = []
        self._closed = False
        self._loaded: dict[str, _Loaded] = {}
        self._active: AdapterSet = ()
        self._running: list[_Seq] = []  # sequences in the generator
        self.eos = eos_ids(self.model_dir)
        self.max_batch_seqs = 0
        ready: Future = Future()
        self._thread = threading.Thread(target=self._worker, args=(ready,), daemon=True, name="exllamav3-engine")
        self._thread.start()
        ready.result()

    # -- the worker thread ------------------------------------------------------------------------------
    def _load_model(self) -> None:
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        try:
            from exllamav3.model.lora import LoRA  # noqa: F401 - checked here, used by _place
        except ImportError as e:
            raise UserError(f"this exllamav3 has no run-time LoRA (exllamav3.model.lora: {e})",
                            "install an exllamav3 with exllamav3/model/lora.py (1.4 or later)") from e
        config = Config.from_directory(str(self.model_dir))
        self.model = Model.from_config(config)
        self.cache = Cache(self.model, max_num_tokens=self.cache_tokens)  # before load(): load allocates it
        self.model.load()
        self.tokenizer = Tokenizer.from_config(config)
        self.generator = Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer,
                                   max_batch_size=self.max_batch)
        if not callable(getattr(getattr(self.generator, "pagetable", None), "reset_page_table", None)):
            raise RuntimeError("this exllamav3's Generator has no pagetable.reset_page_table(): its prefix cache "
                               "cannot be dropped when the adapter set changes")
        self.n_vocab = int(config.vocab_size)
        self.fast = FastPaths(self.model)

    def _started(self, ready: Future) -> bool:
        """Load the model on this thread; the constructor waits on ``ready`` and raises what failed."""
        try:
            self._load_model()
            ready.set_result(None)
            return True
        except BaseException as e:  # noqa: BLE001 - the constructor raises it
            ready.set_exception(e)
            return False

    def _worker(self, ready: Future) -> None:
        if not self._started(ready):
            return
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every waiting request gets it
            log.exception("the ExLlamaV3 engine stopped")
            self._fail_all(e if isinstance(e, Exception) else RuntimeError(str(e)))
        finally:
            for s in self._running:
                s.out.put(RuntimeError("engine closed"))
            self._running.clear()

    def _loop(self) -> None:
        running = self._running
        while True:
            with self._cv:
                while not (self.turns.pending or self._jobs or running or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
                jobs, self._jobs = self._jobs, []
                for s in [s for s in self.turns.pending if s.cancelled]:
                    self.turns.pending.remove(s)
                    s.out.put(Done(s.index))
                key, admit = self.turns.admit(len(running))
            for fn, fut in jobs:  # adapters load and unload between steps, never during one
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the caller raises it
                    fut.set_exception(e)
            for s in [s for s in admit if any(name not in self._loaded for name, _ in s.key)]:
                admit.remove(s)
                s.out.put(UserError("the request's adapter was unloaded meanwhile", "retry the request"))
            if admit and key != self._active:
                try:
                    self._activate(key)
                except Exception as e:  # noqa: BLE001 - these requests fail, the engine goes on
                    log.exception("ExLlamaV3 could not switch adapters")
                    self._activate(())
                    for s in admit:
                        s.out.put(e)
                    admit = []
            for s in admit:
                try:
                    s.job = self._job(s)
                    self.generator.enqueue(s.job)  # asserts the job fits the cache and the batch
                except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                    log.exception("ExLlamaV3 refused a job")
                    s.out.put(e)
                    continue
                running.append(s)
            for s in [s for s in running if s.cancelled]:
                self.generator.cancel(s.job)
                running.remove(s)
                s.out.put(Done(s.index))
            if running:
                self.max_batch_seqs = max(self.max_batch_seqs, len(running))
                try:
                    self._step(running)
                except Exception as e:  # noqa: BLE001 - the batch fails, the engine goes on
                    log.exception("ExLlamaV3 step failed")
                    self.generator.clear_queue()
                    for s in running:
                        s.out.put(e)
                    running.clear()

    def _job(self, s: _Seq):
        import torch
        from exllamav3 import Job
        from exllamav3.generator.sampler import ArgmaxSampler, TopPSampler

        r = s.req
        sampler = ArgmaxSampler() if r.temperature <= 0 else TopPSampler(r.top_p, temperature=r.temperature)
        # max_new_tokens one over: exllamav3's Job ends after max_new_tokens - 1 tokens (job.py: ``max_new_tokens
        # - 1 or 1``, checked against the tokens accepted so far); Sequence.emit ends the request at max_tokens
        # and the job is cancelled then. No stop conditions: stop tokens and EOS are Sequence.emit's too.
        return Job(input_ids=torch.tensor([r.prompt_tokens], dtype=torch.long), max_new_tokens=r.max_tokens + 1,
                   sampler=sampler, seed=r.seed, stop_conditions=[], return_logits=r.logprobs is not None,
                   identifier=s)

    def _step(self, running: list[_Seq]) -> None:
        """One generator iteration: each sequence's new tokens handed over (stops decided by ``Sequence.emit``)."""
        for r in self.generator.iterate():
            s = r.get("identifier")
            if not isinstance(s, _Seq) or s not in running or r.get("stage") != "streaming":
                continue
            s.job = r.get("job", s.job)  # a job the generator requeued is a new object
            ids = r.get("token_ids")
            logits = r.get("logits")
            done = False
            for i, tok in enumerate(ids[0].tolist() if ids is not None else []):
                row = logits[0, i, : self.n_vocab].float().cpu().numpy() if logits is not None else None
                if done := s.emit(int(tok), int(tok) in self.eos, row):
                    break
            if done or r.get("eos"):
                if not done:  # the generator ended it (max_new_tokens): emit already sent Done then
                    s.out.put(Done(s.index))
                if not r.get("eos"):
                    self.generator.cancel(s.job)
                running.remove(s)

    def _activate(self, key: AdapterSet) -> None:
        """Register ``key``'s tensors (scaled) on their linears, none else; the generator is idle."""
        for loaded in self._loaded.values():
            for module, _, _ in loaded.tensors:
                module.lora_a_tensors.pop(loaded.lora, None)
                module.lora_b_tensors.pop(loaded.lora, None)
        for name, scale in key:
            loaded = self._loaded[name]
            for module, a, b in loaded.tensors:
                module.lora_a_tensors[loaded.lora] = a
                module.lora_b_tensors[loaded.lora] = b if scale == 1.0 else b * scale
        self.fast.off() if key else self.fast.on()
        self.generator.pagetable.reset_page_table()  # cached pages hold another adapter set's K/V
        self._active = key

    def _scrub(self) -> None:
        """Every LoRA tensor that is not the active set's taken off the model's linears (after a failed load)."""
        keep = {self._loaded[name].lora for name, _ in self._active if name in self._loaded}
        for m in self.model:
            for table in (getattr(m, "lora_a_tensors", None), getattr(m, "lora_b_tensors", None)):
                if isinstance(table, dict):
                    for lora in [k for k in table if k not in keep]:
                        del table[lora]

    def _fail_all(self, e: Exception) -> None:
        with self._cv:
            self._closed = True
            for s in self.turns.pending:
                s.out.put(e)
            self.turns.pending.clear()
            for _, fut in self._jobs:
                fut.set_exception(RuntimeError("the ExLlamaV3 engine stopped"))
            self._jobs.clear()

    def _call(self, fn: Callable[[], object]) -> object:
        """``fn()`` run on the engine thread between two steps: its result, or its exception raised here."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the ExLlamaV3 engine is closed")
            done: Future = Future()
            self._jobs.append((fn, done))
            self._cv.notify_all()
        return done.result()

    # -- adapters ------------------------------------------------------------------------------------
    def load_adapter(self, name: str, directory: Path) -> int:
        """Load the rewritten PEFT directory as ``name`` (its tensors stashed, not applied); bytes held."""
        return int(self._call(lambda: self._place(name, directory)))

    def _place(self, name: str, directory: Path) -> int:
        from exllamav3.model.lora import LoRA

        if name in self._loaded:
            raise UserError(f"adapter {name!r} is already loaded", "unload it first")
        try:
            lora = LoRA.from_directory(self.model, str(directory))
        except BaseException:
            self._scrub()  # a load that failed half-way leaves tensors on the linears, applied to every request
            raise
        pairs = {key: (m, m.lora_a_tensors.pop(lora, None), m.lora_b_tensors.pop(lora, None))
                 for key, m in lora.target_modules.items()}
        tensors = [(m, a, b) for m, a, b in pairs.values() if a is not None and b is not None]
        placed = {key for key, (_, a, b) in pairs.items() if a is not None and b is not None}
        if missing := unplaced(adapter_modules(Path(directory)), placed):
            raise UserError(f"exllamav3 placed {len(placed)} of adapter {name}'s modules, not e.g. {missing[0]}: it "
                            "would apply only in part", "it was trained for another model")
        if not tensors:
            raise UserError(f"exllamav3 matched none of adapter {name}'s modules", "it was trained for another model")
        nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b in tensors)
        self._loaded[name] = _Loaded(lora, tensors, nbytes)
        return nbytes

    def unload_adapter(self, name: str) -> None:
        self._call(functools.partial(self._drop, name))

    def _drop(self, name: str) -> None:
        loaded = self._loaded.pop(name, None)
        if loaded is None:
            raise UserError(f"adapter {name!r} is not loaded", "")
        if any(n == name for n, _ in self._active):
            if self._running:  # the pool never unloads an adapter in use; never reset pages under a batch
                self._loaded[name] = loaded
                raise RuntimeError(f"adapter {name!r} is in use by running requests")
            self._activate(())
        loaded.lora.unload()

    # -- requests ------------------------------------------------------------------------------------
    def events(self, request: GenerationRequest) -> Iterator[Event]:
        """The events of ``request``: one choice, log-probabilities of generated tokens when asked."""
        check_request(request, self.n_ctx)
        if request.max_tokens <= 0:
            return EventStream([])
        with self._cv:
            if missing := [n for n in request.adapters if n not in self._loaded]:
                raise UserError(f"adapter(s) {missing} not loaded", "load them first")
            if self._closed:
                raise RuntimeError("engine closed")
            seq = _Seq(request, key=adapter_set(request.adapters))
            self.turns.add(seq)
            self._cv.notify_all()
        return seq.events()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._fail_all(RuntimeError("engine closed"))
        model = getattr(self, "model", None)
        if model is not None:
            model.unload()


def adapter_modules(directory: Path) -> set[str]:
    """The module paths a PEFT directory holds a ``lora_A`` for, as its keys spell them (PEFT prefix included)."""
    from safetensors import safe_open

    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        return set()
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    return {".".join(k.split(".")[: k.split(".").index("lora_A")]) for k in keys if "lora_A" in k.split(".")}


def unplaced(expected: set[str], placed: set[str]) -> list[str]:
    """The paths of ``expected`` that no placed module key ends (exllamav3 matches PEFT paths by key suffix)."""
    return sorted(p for p in expected if not any(p == k or p.endswith("." + k) for k in placed))


def eos_ids(model_dir: Path) -> set[int]:
    """The end-of-generation token ids the model's config and generation config name."""
    import json

    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        out |= {ids} if isinstance(ids, int) else {i for i in ids or () if isinstance(i, int)}
    return out


def check_request(request: GenerationRequest, n_ctx: int) -> None:
    """Refuse what this engine does not do (before anything is queued)."""
    if request.n != 1 or request.prompt_logprobs or request.grammar:
        raise UserError("the ExLlamaV3 engine answers one choice, without prompt scores or grammars",
                        "serve with --engine llamacpp or vllm for n, echo and response_format")
    prompt = request.prompt_tokens
    if not prompt or len(prompt) + request.max_tokens > n_ctx:
        raise UserError(f"prompt of {len(prompt)} tokens + max_tokens {request.max_tokens} does not fit the "
                        f"context of {n_ctx}", "shorten the prompt or lower max_tokens")
