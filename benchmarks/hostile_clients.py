"""Hostile clients against ``tuneport serve --engine vllm`` and, as the baseline, against vLLM's own OpenAI server
(the one tuneport runs behind its gateway, reached directly on its port): every case of tests/hostile.py, its
answer, how long it took and how much the process that read the request grew, side by side; then the targets.

The baseline reads a body whole whatever its size and tokenizes what it gets, so its floods are capped at
``--baseline-flood-mib`` (default 64) where tuneport gets the full 400 MiB / 100 MiB.

``--overhead``: what the limits cost normal traffic instead: the tiny llama on llama.cpp served in this process
with tuneport's httptools protocol, its h11 protocol, and uvicorn's own httptools protocol without the limits (the
baseline), alternating rounds; 300 sequential 1-token completions and 20 streams of 200 tokens each round.
Run: python benchmarks/hostile_clients.py [--baseline-flood-mib 64] [--overhead [--rounds 3]]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests"))  # the suite itself: one definition of every case
from _util import machine, table  # noqa: E402
from hostile import CASES, MIB, ServeProcess, Target, normal_answer, run_case, warm_up  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, _HERE.parent / "tests")]

from tuneport.serve.engines.child import free_port  # noqa: E402
from tuneport.toolkit.tiny import TinyZoo  # noqa: E402

TIMEOUTS = ["--body-timeout", "2", "--header-timeout", "2", "--idle-timeout", "2", "--send-timeout", "2"]


def overhead(zoo: TinyZoo, rounds: int) -> None:
    import statistics
    import time

    import httpx

    import tuneport
    from tuneport.serve.gateway import connections

    limited = connections.uvicorn_settings
    modes = {"tuneport, httptools": ("httptools", limited), "tuneport, h11": ("h11", limited),
             "uvicorn httptools, no limits": ("httptools", lambda limits: {"http": "httptools"})}
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, (protocol, settings) in modes.items():
            os.environ["TUNEPORT_HTTP_PROTOCOL"] = protocol
            connections.uvicorn_settings = settings
            with tuneport.serve(base=zoo.base("llama"), engine="llamacpp", port=0, n_ctx=256) as server, \
                    httpx.Client(base_url=server.url, timeout=60) as c:
                body = {"model": server.backend.name, "prompt": "The model", "max_tokens": 1, "temperature": 0}
                for _ in range(30):
                    c.post("/v1/completions", json=body)
                t = time.perf_counter()
                for _ in range(300):
                    c.post("/v1/completions", json=body)
                whole = (time.perf_counter() - t) / 300 * 1000
                t = time.perf_counter()
                for _ in range(20):
                    with c.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True,
                                                                   "stream": True}) as r:
                        for _line in r.iter_lines():
                            pass
                times[mode].append((whole, (time.perf_counter() - t) / 20 * 1000))
    connections.uvicorn_settings = limited
    base = [statistics.median(x[i] for x in times["uvicorn httptools, no limits"]) for i in (0, 1)]
    rows = []
    for mode, got in times.items():
        med = [statistics.median(x[i] for x in got) for i in (0, 1)]
        rows.append([mode, f"{med[0]:.2f}", f"{med[0] / base[0]:.2f}x", f"{med[1]:.1f}", f"{med[1] / base[1]:.2f}x",
                     " / ".join(f"{w:.2f}, {s:.0f}" for w, s in got)])
    print(f"what the limits cost normal traffic (tiny llama, llama.cpp, in process; median of {rounds} rounds)\n"
          f"machine: {machine()}\n")
    print(table(rows, ["server", "ms / request", "vs baseline", "ms / 200-token stream", "vs baseline",
                       "rounds (request ms, stream ms)"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-flood-mib", type=int, default=64)
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hostile-bench-"))
    os.environ.setdefault("TUNEPORT_CACHE_DIR", str(root / "cache"))
    zoo = TinyZoo(root / "zoo")
    if args.overhead:
        return overhead(zoo, args.rounds)
    engine_port = free_port()
    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(root / "cache")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny model needs next to nothing
    server = ServeProcess(["--base", str(zoo.base("llama")), "--engine", "vllm", "--dtype", "fp32",
                           "--max-model-len", "256", "--engine-port", str(engine_port), "--log-file",
                           str(root / "vllm.log"), *TIMEOUTS, "--", "--enforce-eager", "--max-num-seqs", "8"],
                          free_port(), root / "serve.log", 900, env)
    try:
        model = server.model()
        gateway = Target("127.0.0.1", int(server.url.rsplit(":", 1)[1]), [server.proc.pid], model,
                         body_timeout_s=2, header_timeout_s=2, send_timeout_s=2)
        vllm = Target("127.0.0.1", engine_port, server.children("vllm.entrypoints"), model, body_timeout_s=2,
                      header_timeout_s=2, send_timeout_s=2, flood_cap=args.baseline_flood_mib * MIB)
        rows, ours = [], {}
        for target in (gateway, vllm):
            warm_up(target)
            target.normal_answer = normal_answer(target)
        for case in CASES:
            a, b = run_case(gateway, case), run_case(vllm, case)
            ours[case.name] = a
            rows.append([case.name, case.expected, f"{a.got} in {a.ms:.0f} ms, +{a.growth:.1f} MiB",
                         f"{b.got} in {b.ms:.0f} ms, +{b.growth:.1f} MiB", b.note if "MiB" in b.note else ""])
    finally:
        server.stop()
    print(f"hostile clients: tuneport serve --engine vllm (gateway process) against vLLM's own server (API process)"
          f"\nmachine: {machine()}\n")
    print(table(rows, ["case", "must get", "tuneport serve", "vLLM direct", "vLLM direct sent"]))
    flood, unknown = ours["chunked body, 400 MiB offered"], ours["unknown model, 100 MiB chunked prompt"]
    growth = max(o.growth for o in ours.values())
    print(f"\ntargets: 400 MiB chunked -> 413 {flood.ms:.0f} ms after the limit (< 1000 ms: "
          f"{'met' if flood.got == '413' and flood.ms < 1000 else 'NOT met'}); unknown model, 100 MiB -> "
          f"{unknown.got} {unknown.ms:.0f} ms from the first byte (< 100 ms: "
          f"{'met' if unknown.ms < 100 else 'NOT met'}); largest RSS growth in a case {growth:.1f} MiB "
          f"(< 16 MiB: {'met' if growth < 16 else 'NOT met'})")


if __name__ == "__main__":
    main()
