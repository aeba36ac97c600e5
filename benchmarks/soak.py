"""Soak: a bounded run of mixed traffic with adapter churn against `tuneport serve`, on llama.cpp and vLLM.

What: `tuneport serve` runs as its own process on 127.0.0.1 (loopback only) over the tiny llama with one
pinned start-up adapter and 8 adapters in `--adapter-dir`, `--max-adapters 5`, so on-demand loads evict
all the time. For `--minutes` (default 10), `--concurrency` (default 16) client threads send completions
and chat completions, streamed and not, to the base, the pinned adapter, the on-demand adapters and the
adapters the churn thread loads. The churn thread, once a second, loads an adapter under a new name through
the admin API (every other one pinned, so that its unload cannot meet an eviction first), unloads it again,
unloads an on-demand adapter, and asks to load a loaded name (409).

Checks (the issue's bar, the baseline every figure is read against):
- 0 wrong answers: every answer is greedy (temperature 0, `ignore_eos`, fixed `max_tokens`) and must equal,
  token for token, the reference for its adapter and prompt computed by a fresh single-adapter instance
  (llama.cpp: a fresh llama.cpp holding only that GGUF LoRA, F32 KV cache; vLLM: transformers + PEFT in fp32,
  as tests/test_serve_vllm.py compares). Non-streamed answers compare `token_ids`; streamed ones their text
  with the text of the verified non-streamed answer. Chat prompts are rendered by the server (its
  `prompt_token_ids`, the same in every answer); their references are computed for those ids.
- 0 unexpected statuses: only the refusals docs/serve.md documents under churn are expected (404 for an
  adapter unloaded or evicted, 409 for an unload while in use or a load of a loaded name, 503 when every
  slot stays in use); any other 4xx or 5xx, a broken stream or a transport error counts as unexpected.
- RSS (the server process and its children) grows under 5% from the end of warm-up to the end.
- `/metrics` agrees with what the client sent: `tuneport_http_requests_total`, `tuneport_requests_total`,
  the latency histogram's count and the completion tokens; the access log's statuses per route equal the
  client's; adapter loads - evictions - unloads = adapters loaded.

Run: python benchmarks/soak.py [--engine llamacpp|vllm|both] [--minutes 10] [--concurrency 16]
     [--warmup-s S] [--workdir DIR]
(vLLM: the CPU build here; VLLM_CPU_KVCACHE_SPACE=1 is set for it when unset.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, table  # noqa: E402

# benchmarks/gguf.py would shadow the gguf package: drop this folder from the path again
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

N_TOKENS = 12
MAX_ADAPTERS = 5  # the pinned adapter + 4 slots for 8 on-demand adapters and the churn's
LLAMACPP_CONTEXTS = 2  # the decode loop's contexts (the second is created under mixed traffic, then kept)
PINNED = ("pinned", "rslora", 1)
ON_DEMAND = [("od-plain", "plain", 1), ("od-all", "all_linear", 1), ("od-patterns", "patterns", 1),
             ("od-regex", "regex", 1), ("od-plain2", "plain", 2), ("od-all2", "all_linear", 2),
             ("od-rslora2", "rslora", 2), ("od-patterns2", "patterns", 2)]
COMPLETION_PROMPTS = [[1, 50, 60, 70], [1, 200, 300, 411, 7], [1, 9, 8, 7, 6, 5], [1, 100, 101, 102, 103, 104, 105]]
CHAT_PROMPTS = ["hi", "Export one file for each adapter."]
# what docs/serve.md says may answer during churn: (route, status, a piece of the message)
EXPECTED = {
    ("gen", 404): "is not loaded",  # an adapter the churn unloaded, or the pool evicted
    ("gen", 503): "",  # "all N adapter slots are pinned or in use" / "evicted while loading"
    ("load", 409): "is already loaded",
    ("load", 503): "adapter slots are pinned or in use",
    ("unload", 404): "is not loaded",  # evicted before the churn unloaded it
    ("unload", 409): "is in use",
}
REFUSAL_503 = ("adapter slots are pinned or in use", "was evicted while loading")


# -- set-up: models, adapters, references -------------------------------------------------------------------
@dataclass
class Setup:
    engine: str
    work: Path
    base: Path  # what `serve --base` gets (llama.cpp: the F32 GGUF; vLLM: the HF directory)
    pinned: Path
    adapter_dir: Path
    hf_base: Path
    peft: dict[str, Path]  # reference name -> PEFT directory
    gguf: dict[str, Path] = field(default_factory=dict)  # reference name -> GGUF LoRA (llama.cpp)


def prepare(engine: str, work: Path, zoo=None) -> Setup:
    """The tiny llama, its adapters (PEFT, and for llama.cpp exported as an F32 GGUF with F32 GGUF LoRAs)
    and the adapter directory the server loads on demand from; ``zoo``: a TinyZoo to take the base from."""
    from tuneport.toolkit.tiny import TinyZoo, make_adapter

    zoo = zoo or TinyZoo(work / "zoo")
    hf_base = zoo.base("llama")
    peft: dict[str, Path] = {}
    for name, variant, seed in [PINNED, *ON_DEMAND]:
        out = work / "peft" / name
        if not (out / "adapter_config.json").exists():
            make_adapter(zoo.base_for("llama", variant), variant, out, seed=seed)
        peft[name] = out
    adapter_dir = work / f"adapters-{engine}"
    shutil.rmtree(adapter_dir, ignore_errors=True)
    adapter_dir.mkdir(parents=True)
    if engine == "vllm":
        for name, *_ in ON_DEMAND:
            shutil.copytree(peft[name], adapter_dir / name)
        return Setup(engine, work, hf_base, peft[PINNED[0]], adapter_dir, hf_base, peft)
    import tuneport

    out = work / "gguf"
    if not (out / "llama-fp32-F32.gguf").exists():
        tuneport.export(base=hf_base, adapters=[f"{n}={p}" for n, p in peft.items()], target="gguf",
                        adapter_mode="separate", quant="f32", out=out)
    gguf = {n: out / "adapters" / f"{n}-F32.gguf" for n in peft}
    for name, *_ in ON_DEMAND:  # a directory holding one .gguf per adapter
        (adapter_dir / name).mkdir()
        shutil.copy(gguf[name], adapter_dir / name / gguf[name].name)
    return Setup(engine, work, out / "llama-fp32-F32.gguf", gguf[PINNED[0]], adapter_dir, hf_base, peft, gguf)


def references(setup: Setup, prompts: list[list[int]]) -> dict[tuple[str | None, int], list[int]]:
    """Greedy tokens per (reference name or None for the base, prompt index) from a fresh instance holding
    only that adapter."""
    names: list[str | None] = [None, *setup.peft]
    out: dict[tuple[str | None, int], list[int]] = {}
    if setup.engine == "llamacpp":
        from tuneport.toolkit.fidelity import llamacpp_greedy

        for name in names:
            for i, p in enumerate(prompts):  # one fresh llama.cpp per answer
                out[(name, i)] = llamacpp_greedy(setup.base, setup.gguf[name] if name else None, p, N_TOKENS,
                                                 n_ctx=256)
        return out
    from tuneport.toolkit.fidelity import greedy, load_hf, load_peft

    for name in names:
        model = load_peft(setup.hf_base, setup.peft[name]) if name else load_hf(setup.hf_base)
        for i, p in enumerate(prompts):
            out[(name, i)] = greedy(model, p, N_TOKENS)
        del model
    return out


def start_server(setup: Setup, concurrency: int) -> tuple[subprocess.Popen, str, Path]:
    """`tuneport serve` as its own process (its RSS is the server's alone); (process, url, its stderr log)."""
    from tuneport.serve.engines.vllm import free_port
    from tuneport.serve.http import wait_for_health
    from tuneport.serve.options import ServeOptions
    from tuneport.serve.server import tuneport_argv

    port = free_port()
    common = dict(base=setup.base, adapters={PINNED[0]: str(setup.pinned)}, adapter_dir=setup.adapter_dir,
                  max_adapters=MAX_ADAPTERS, host="127.0.0.1", port=port, concurrency=concurrency)
    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(setup.work / "cache")}
    if setup.engine == "llamacpp":
        opts = ServeOptions(**common, n_ctx=256, contexts=LLAMACPP_CONTEXTS, kv_f32=True)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        opts = ServeOptions(**common, dtype="fp32", max_model_len=256, max_loras=3, max_lora_rank=16,
                            engine_port=free_port(), log_file=setup.work / "vllm.log",
                            vllm_args=["--enforce-eager", "--max-num-seqs", str(concurrency)])
    argv = tuneport_argv(opts, setup.engine)
    cmd = [sys.executable, "-m", "tuneport", "--log-level", "info", *argv[1:]]
    log = setup.work / f"serve-{setup.engine}.log"  # the access log too: a file, never a pipe that could fill
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    if not wait_for_health(url, 900, alive=lambda: proc.poll() is None):
        stop_server(proc)
        raise RuntimeError(f"tuneport serve did not come up:\n{log.read_text()[-3000:]}")
    return proc, url, log


def stop_server(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(30)


# -- the client side -----------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for the unlabelled samples (``tuneport_`` dropped)."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"tuneport_(\w+) (\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def server_memory(pid: int) -> tuple[int, int]:
    """(resident bytes, major page faults so far) of the server process and its children (vLLM's API server
    and engine core). Major faults tell a run whose pages the machine took back under memory pressure."""
    import psutil

    top = psutil.Process(pid)
    rss = faults = 0
    for p in [top, *top.children(recursive=True)]:
        try:
            rss += p.memory_info().rss
            stat = Path(f"/proc/{p.pid}/stat").read_text()
            faults += int(stat[stat.rindex(")") + 2:].split()[9])
        except (psutil.Error, OSError, ValueError, IndexError):
            pass
    return rss, faults


def rss_bytes(pid: int) -> int:
    return server_memory(pid)[0]


class Refused(Exception):  # noqa: N818 - a streamed request answered with an error status
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def sample(pid: int, t0: float, soak: Soak, out: list, every_s: float = 10.0) -> None:
    """Every ``every_s`` until the soak stops: (s into the soak, RSS MB, major faults, answers so far, the
    machine's 1-minute load average)."""
    while not soak.stop.wait(every_s):
        try:
            rss, faults = server_memory(pid)
        except Exception:  # noqa: BLE001 - the server went away: the soak itself reports it
            return
        out.append((round(time.monotonic() - t0), round(rss / 2**20, 1), faults, soak.tokens["answered"],
                    round(os.getloadavg()[0], 1)))


@dataclass
class Job:
    model: str  # the OpenAI model name sent
    ref: str | None  # the reference it must equal (None: the base)
    cls: str  # base | pinned | ondemand | runtime
    chat: int | None  # chat prompt index, else a completion prompt index in prompt
    prompt: int
    stream: bool


@dataclass
class Soak:
    """The traffic, the churn and the tallies of one soak against a running server at ``url``."""

    url: str
    pid: int
    base_name: str
    adapter_dir: Path
    concurrency: int = 16
    seed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: Counter = field(default_factory=Counter)  # (method path, status) -> requests
    outcome: Counter = field(default_factory=Counter)  # ok, wrong, refused <route> <status>, unexpected ...
    problems: list = field(default_factory=list)  # the first unexpected answers and wrong ones, for the report
    refs: dict = field(default_factory=dict)  # (reference, prompt key) -> token ids
    ref_text: dict = field(default_factory=dict)  # (reference, prompt key) -> text of a verified answer
    chat_ids: dict = field(default_factory=dict)  # chat prompt index -> the prompt ids the server renders
    runtime: deque = field(default_factory=lambda: deque(maxlen=3))  # (name, reference) the churn loaded
    tokens: Counter = field(default_factory=Counter)  # prompt / completion tokens of answered requests
    churn_counts: Counter = field(default_factory=Counter)
    names: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # runtime names are never reused
    stop: threading.Event = field(default_factory=threading.Event)

    # one counted HTTP call: every request the client sends is in ``sent``, by route and status
    def call(self, client: httpx.Client, method: str, path: str, **kw) -> httpx.Response:
        route = re.sub(r"^/v1/adapters/.+", "/v1/adapters/{name}", path)
        try:
            r = client.request(method, path, **kw)
        except httpx.HTTPError as e:
            self.note("unexpected transport", f"{method} {path}: {e!r}")
            raise
        with self.lock:
            self.sent[(f"{method} {route}", r.status_code)] += 1
        return r

    def note(self, outcome: str, detail: str | None = None) -> None:
        with self.lock:
            self.outcome[outcome] += 1
            if detail and len(self.problems) < 20:
                self.problems.append(f"{outcome}: {detail}")

    def refusal(self, route: str, r: httpx.Response, what: str, allowed: bool = True) -> None:
        """A non-2xx answer: expected when docs/serve.md lists it for ``route`` (and ``allowed``)."""
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        want = EXPECTED.get((route, r.status_code))
        ok = allowed and want is not None and (want in msg if want else any(s in msg for s in REFUSAL_503))
        if ok:
            self.note(f"refused {route} {r.status_code}")
        else:
            kind = "5xx" if r.status_code >= 500 else "other"
            self.note(f"unexpected {kind}", f"{what} -> {r.status_code} {msg}")

    # -- generation requests --------------------------------------------------------------------------------
    def body(self, job: Job) -> tuple[str, dict]:
        common = {"model": job.model, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}
        if job.chat is not None:
            path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user",
                                                                          "content": CHAT_PROMPTS[job.chat]}]}
        else:
            path, body = "/v1/completions", {**common, "prompt": COMPLETION_PROMPTS[job.prompt]}
        if job.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        else:
            body["return_token_ids"] = True
        return path, body

    def key(self, job: Job) -> tuple[str | None, str]:
        return job.ref, f"chat{job.chat}" if job.chat is not None else f"p{job.prompt}"

    def prompt_ids(self, job: Job) -> list[int]:
        return self.chat_ids[job.chat] if job.chat is not None else COMPLETION_PROMPTS[job.prompt]

    def request(self, client: httpx.Client, job: Job) -> None:
        path, body = self.body(job)
        what = f"{job.model} {'chat' if job.chat is not None else 'completion'} {self.key(job)[1]}" + \
               (" stream" if job.stream else "")
        with self.lock:
            self.outcome["streamed" if job.stream else "whole"] += 1
            self.outcome["chat" if job.chat is not None else "completion"] += 1
        ref = self.refs[self.key(job)]
        if not job.stream:
            r = self.call(client, "POST", path, json=body)
            if r.status_code != 200:
                return self.gen_refused(job, r, what)
            a = r.json()
            choice = a["choices"][0]
            text = choice["message"]["content"] if job.chat is not None else choice["text"]
            bad = []
            if choice.get("token_ids") != ref:
                bad.append(f"tokens {choice.get('token_ids')} != reference {ref}")
            prompt_ids = a.get("prompt_token_ids") or choice.get("prompt_token_ids")  # vLLM: per choice
            if prompt_ids != self.prompt_ids(job):
                bad.append(f"prompt_token_ids {prompt_ids} != {self.prompt_ids(job)}")
            if a["model"] != job.model or a["usage"]["completion_tokens"] != N_TOKENS:
                bad.append(f"model {a['model']} usage {a['usage']}")
            if not bad:
                with self.lock:
                    text_ref = self.ref_text.setdefault(self.key(job), text)
                if text != text_ref:
                    bad.append(f"text {text!r} != {text_ref!r}")
            return self.judge(job, what, bad, a["usage"])
        try:
            pieces, usage, done, models = self.read_stream(client, path, body, job)
        except httpx.HTTPError as e:
            return self.note("unexpected transport", f"{what}: {e!r}")
        except Refused as e:
            return self.gen_refused(job, e.response, what)
        with self.lock:
            self.sent[(f"POST {path}", 200)] += 1
            text_ref = self.ref_text.get(self.key(job))
        text = "".join(pieces)
        bad = []
        if not done:
            bad.append("the stream ended without [DONE]")
        if text_ref is not None and text != text_ref:
            bad.append(f"text {text!r} != {text_ref!r}")
        if models != {job.model} or not usage or usage["completion_tokens"] != N_TOKENS:
            bad.append(f"models {models} usage {usage}")
        self.judge(job, what, bad, usage or {})

    def gen_refused(self, job: Job, r: httpx.Response, what: str) -> None:
        """404 only for the churn's adapters (unloaded, or evicted before anything held them); 503 only for
        adapters that need a slot."""
        with self.lock:
            self.tokens["refused prompt"] += len(self.prompt_ids(job))
        self.refusal("gen", r, what, allowed=job.cls == "runtime" or job.cls == "ondemand" and r.status_code == 503)

    def read_stream(self, client: httpx.Client, path: str, body: dict, job: Job) -> tuple:
        """A streamed answer: (text pieces, usage, whether [DONE] came, the models named); Refused when the
        status is not 200."""
        with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                with self.lock:
                    self.sent[(f"POST {path}", r.status_code)] += 1
                raise Refused(r)
            pieces, usage, done, models = [], None, False, set()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    pieces.append(f"<error {chunk['error']}>")
                models.add(chunk.get("model"))
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    pieces.append((c.get("delta") or {}).get("content") or "" if job.chat is not None
                                  else c.get("text") or "")
        return pieces, usage, done, models

    def judge(self, job: Job, what: str, bad: list[str], usage: dict) -> None:
        if bad:
            self.note("wrong", f"{what}: {'; '.join(bad)}")
        else:
            self.note("ok")
        with self.lock:
            self.tokens["prompt"] += usage.get("prompt_tokens", 0)
            self.tokens["completion"] += usage.get("completion_tokens", 0)
            self.tokens["answered"] += 1

    # -- traffic ---------------------------------------------------------------------------------------
    def pick(self, rng: random.Random) -> Job:
        x = rng.random()
        with self.lock:
            runtime = list(self.runtime)
        if x < 0.15:
            model, ref, cls = self.base_name, None, "base"
        elif x < 0.30:
            model, ref, cls = PINNED[0], PINNED[0], "pinned"
        elif x < 0.40 and runtime:
            (model, ref), cls = rng.choice(runtime), "runtime"
        else:
            model = rng.choice(ON_DEMAND)[0]
            ref, cls = model, "ondemand"
        chat = rng.randrange(len(CHAT_PROMPTS)) if rng.random() < 0.3 else None
        return Job(model, ref, cls, chat, rng.randrange(len(COMPLETION_PROMPTS)), rng.random() < 0.5)

    def worker(self, n: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + n)
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while time.monotonic() < until and not self.stop.is_set():
                job = self.pick(rng)
                try:
                    self.request(client, job)
                except httpx.HTTPError:
                    pass  # noted as a transport error by call()
                except Exception as e:  # noqa: BLE001 - a malformed answer is a finding, not a crash
                    self.note("unexpected other", f"{job}: {e!r}")

    def churn(self, until: float, every_s: float = 1.0) -> None:
        """Once every ``every_s``: an admin load under a new name, its unload at once or a moment later (or its
        eviction first), every fifth time a load of a loaded name (409), and an unload of a loaded on-demand
        adapter (404 when the pool evicted it first, 409 while a request holds it)."""
        rng = random.Random(self.seed * 1000 + 999)
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while time.monotonic() < until and not self.stop.is_set():
                k = next(self.names)
                try:
                    name, source = f"rt-{k}", rng.choice(ON_DEMAND)[0]
                    pinned = k % 2 == 0  # a pinned one cannot be evicted first: its unload must succeed
                    r = self.call(client, "POST", "/v1/adapters",
                                  json={"name": name, "path": str(self.adapter_dir / source), "pinned": pinned})
                    if r.status_code == 201:
                        with self.lock:
                            self.churn_counts["admin loads"] += 1
                            self.runtime.append((name, source))
                        if rng.random() < 0.5:  # the traffic may use it meanwhile (or evict it: LRU under thrash)
                            time.sleep(rng.uniform(0, every_s / 10))
                        for _ in range(30 if pinned else 3):  # a pinned one: until no request holds it
                            r = self.call(client, "DELETE", f"/v1/adapters/{name}")
                            if r.status_code == 200:
                                self.churn_counts["admin unloads"] += 1
                                break
                            # 404: evicted (never a pinned one); 409: in use
                            self.refusal("unload", r, f"unload {name}", allowed=r.status_code == 409 or not pinned)
                            if r.status_code != 409:
                                break
                            time.sleep(every_s / 10)
                    else:
                        self.refusal("load", r, f"load {name}", allowed=r.status_code == 503)
                    if k % 5 == 0:  # the pinned adapter is always loaded: 409
                        r = self.call(client, "POST", "/v1/adapters",
                                      json={"name": PINNED[0], "path": str(self.adapter_dir / source)})
                        self.refusal("load", r, f"load {PINNED[0]} again", allowed=r.status_code == 409)
                    r = self.call(client, "GET", "/v1/adapters")
                    loaded = [a["name"] for a in r.json().get("adapters", [])] if r.status_code == 200 else []
                    on_demand = [n for n, *_ in ON_DEMAND]
                    victim = rng.choice([n for n in loaded if n in on_demand] or on_demand)
                    r = self.call(client, "DELETE", f"/v1/adapters/{victim}")
                    if r.status_code == 200:
                        self.churn_counts["admin unloads"] += 1
                    else:
                        self.refusal("unload", r, f"unload {victim}")
                except httpx.HTTPError:
                    pass  # noted as a transport error by call()
                time.sleep(every_s)

    def traffic(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=self.worker, args=(n, until)) for n in range(self.concurrency)]
        threads.append(threading.Thread(target=self.churn, args=(until,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def run_soak(setup: Setup, seconds: float, concurrency: int = 16, warmup_s: float | None = None,
             seed: int = 0) -> dict:
    """Start the server for ``setup``, soak it for ``seconds`` (warm-up included), stop it; the figures."""
    warmup_s = max(10.0, seconds / 10) if warmup_s is None else warmup_s
    phases = {}  # seconds each phase took
    t = time.perf_counter()
    proc, url, log = start_server(setup, concurrency)
    phases["start"] = time.perf_counter() - t
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            base_name = c.get("/health").json()["model"]
            soak = Soak(url, proc.pid, base_name, setup.adapter_dir, concurrency, seed)
            # every request from here on is counted (this /metrics answer itself included)
            m0 = parse_metrics(soak.call(c, "GET", "/metrics").text)
            for i, _ in enumerate(CHAT_PROMPTS):  # the prompt ids the server renders (its chat template)
                r = soak.call(c, "POST", "/v1/chat/completions", json={
                    "model": base_name, "messages": [{"role": "user", "content": CHAT_PROMPTS[i]}],
                    "max_tokens": 1, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                r.raise_for_status()
                soak.chat_ids[i] = r.json()["prompt_token_ids"]
                soak.tokens["prompt"] += r.json()["usage"]["prompt_tokens"]
                soak.tokens["completion"] += r.json()["usage"]["completion_tokens"]
                soak.tokens["answered"] += 1
            prompts = COMPLETION_PROMPTS + [soak.chat_ids[i] for i in range(len(CHAT_PROMPTS))]
            keys = [f"p{i}" for i in range(len(COMPLETION_PROMPTS))] + [f"chat{i}" for i in range(len(CHAT_PROMPTS))]
            t = time.perf_counter()
            refs = references(setup, prompts)
            phases["references"] = time.perf_counter() - t
            t = time.perf_counter()
            soak.refs = {(name, keys[i]): toks for (name, i), toks in refs.items()}
            # every (model, prompt) once, not streamed, one at a time: the texts streamed answers are held to
            for model, ref, cls in [(base_name, None, "base"), (PINNED[0], PINNED[0], "pinned"),
                                    *((n, n, "ondemand") for n, *_ in ON_DEMAND)]:
                for chat in [None, *range(len(CHAT_PROMPTS))]:
                    for p in range(len(COMPLETION_PROMPTS)) if chat is None else [0]:
                        soak.request(c, Job(model, ref, cls, chat, p, False))
            phases["first answers"] = time.perf_counter() - t
            t0 = time.monotonic()
            samples: list[tuple] = []
            faults0 = server_memory(proc.pid)[1]
            sampler = threading.Thread(target=sample, args=(proc.pid, t0, soak, samples), daemon=True)
            sampler.start()
            soak.traffic(warmup_s)
            while setup.engine == "llamacpp" and parse_metrics(soak.call(c, "GET", "/metrics").text).get(
                    "llamacpp_contexts", 0) < LLAMACPP_CONTEXTS and time.monotonic() - t0 < seconds / 2:
                soak.traffic(5)  # warm-up lasts until the second context exists (allocated once, lazily)
            rss_warm = rss_bytes(proc.pid)
            soak.traffic(max(0.0, seconds - warmup_s))
            soak_s = time.monotonic() - t0
            rss_end, faults = server_memory(proc.pid)
            soak.stop.set()
            sampler.join()
            time.sleep(0.5)  # the access log and counters of the last answers are written after they are sent
            listed = len(soak.call(c, "GET", "/v1/adapters").json()["adapters"])
            m1 = parse_metrics(soak.call(c, "GET", "/metrics").text)  # counted once its answer is sent
    except httpx.TransportError as e:  # the server went away: say how, with what it last logged
        raise RuntimeError(f"tuneport serve stopped answering ({e}); exit code {proc.poll()}, its log ends:\n"
                           f"{log.read_text(errors='replace')[-4000:]}") from e
    finally:
        t = time.perf_counter()
        rc = stop_server(proc)
        phases["stop"] = time.perf_counter() - t
    r = report(setup.engine, soak, m0, m1, listed, rss_warm, rss_end, samples, log, soak_s, rc)
    return {**r, "major_faults": faults - faults0, "load_avg_max": max((x[4] for x in samples), default=None),
            "phases_s": {k: round(v, 1) for k, v in phases.items()}}


def access_statuses(log: Path) -> Counter:
    """(method path, status) -> lines of the access log (admin unloads folded into one route)."""
    out: Counter = Counter()
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r'tuneport\.access: \S+ "(\w+) (\S+)" (\d{3})', line)
        if m:
            out[(f"{m.group(1)} {re.sub(r'^/v1/adapters/.+', '/v1/adapters/{name}', m.group(2))}",
                 int(m.group(3)))] += 1
    return out


def report(engine: str, soak: Soak, m0: dict, m1: dict, listed: int, rss_warm: int, rss_end: int,
           samples: list, log: Path, soak_s: float, rc: int) -> dict:
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    sent_total = sum(soak.sent.values())
    gen = sum(n for (route, _), n in soak.sent.items() if route.endswith("completions"))
    gen_ok = sum(n for (route, st), n in soak.sent.items() if route.endswith("completions") and st == 200)
    unloads = soak.churn_counts["admin unloads"]
    access = access_statuses(log)
    # the access log holds the health checks of the start and the last scrapes too: compare what we sent
    access_seen = {k: access.get(k, 0) for k in soak.sent}
    checks = {
        "http_requests_total": d.get("http_requests_total") == sent_total - 1,  # the last scrape: not yet
        "requests_total": d.get("requests_total") == gen,
        "latency count": d.get("request_latency_seconds_count") == gen,
        "completion tokens": d.get("completion_tokens_total") == soak.tokens["completion"] == N_TOKENS * (
            gen_ok - len(CHAT_PROMPTS)) + len(CHAT_PROMPTS),
        "access log by status": access_seen == dict(soak.sent),
        "loads - evictions - unloads = loaded": m1.get("adapter_loads_total", 0) - m1.get(
            "adapter_evictions_total", 0) - unloads == m1.get("adapters_loaded") == listed,
        "admin loads counted": d.get("adapter_loads_total", 0) >= soak.churn_counts["admin loads"],
    }
    counted = d.get("prompt_tokens_total")
    prompt_tokens = ("answered requests'" if counted == soak.tokens["prompt"] else
                     "answered and refused requests'" if counted == soak.tokens["prompt"] + soak.tokens[
                         "refused prompt"] else f"NO: {counted} counted, {soak.tokens['prompt']} answered")
    refused = Counter({k[len("refused "):]: v for k, v in soak.outcome.items() if k.startswith("refused ")})
    return {
        "engine": engine, "seconds": soak_s, "requests": gen, "answered": gen_ok,
        "streamed": soak.outcome["streamed"], "chat": soak.outcome["chat"], "wrong": soak.outcome["wrong"],
        "unexpected_5xx": soak.outcome["unexpected 5xx"],
        "unexpected_other": soak.outcome["unexpected other"] + soak.outcome["unexpected transport"],
        "refused": dict(refused), "rss_warm_mb": rss_warm / 2**20, "rss_end_mb": rss_end / 2**20,
        "rss_growth_pct": 100 * (rss_end - rss_warm) / rss_warm, "metrics_checks": checks,
        "metrics_consistent": all(checks.values()), "prompt_tokens_counted": prompt_tokens,
        "samples": samples,  # (s, RSS MB, major faults, answers so far, load average) every 10 s
        "loads": d.get("adapter_loads_total", 0), "admin_loads": soak.churn_counts["admin loads"],
        "unloads": unloads, "evictions": d.get("adapter_evictions_total", 0), "problems": soak.problems,
        "tracebacks": log.read_text(errors="replace").count("Traceback"), "exit_code": rc,
    }


def row(r: dict) -> list[str]:
    refused = ", ".join(f"{k}: {v}" for k, v in sorted(r["refused"].items())) or "0"
    return [r["engine"], f"{r['seconds']:.0f}", str(r["requests"]), str(r["streamed"]), str(r["wrong"]),
            str(r["unexpected_5xx"]), str(r["unexpected_other"]), refused,
            f"{r['rss_warm_mb']:.0f} / {r['rss_end_mb']:.0f} / {r['rss_growth_pct']:+.2f}%",
            "yes" if r["metrics_consistent"] else "NO", f"{r['loads']:.0f} / {r['unloads']} / {r['evictions']:.0f}",
            f"{r['load_avg_max']} / {r['major_faults']}"]


HEADER = ["engine", "s", "requests", "streamed", "wrong", "unexpected 5xx", "unexpected other",
          "expected refusals", "RSS MB warm / end / growth", "/metrics consistent", "loads / unloads / evictions",
          "load avg max / major faults"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["llamacpp", "vllm", "both"], default="both")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup-s", type=float, default=None, help="default: a tenth of the run, at least 10 s")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tuneport-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    engines = ["llamacpp", "vllm"] if args.engine == "both" else [args.engine]
    results = []
    for engine in engines:
        r = run_soak(prepare(engine, work), args.minutes * 60, args.concurrency, args.warmup_s)
        results.append(r)
        print(json.dumps(r, default=str), flush=True)
    print(f"machine: {machine()}")
    print(f"soak: {args.minutes:g} min per engine (warm-up included), concurrency {args.concurrency}, "
          f"tiny llama + 1 pinned adapter + {len(ON_DEMAND)} on demand, --max-adapters {MAX_ADAPTERS}, "
          f"{N_TOKENS} greedy tokens per answer, churn once a second")
    print(table([row(r) for r in results], HEADER))
    failed = [r["engine"] for r in results if r["wrong"] or r["unexpected_5xx"] or r["unexpected_other"]
              or r["rss_growth_pct"] >= 5 or not r["metrics_consistent"]]
    if failed:
        raise SystemExit(f"soak failed on {', '.join(failed)}")


if __name__ == "__main__":
    main()
