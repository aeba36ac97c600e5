from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tuneport.toolkit.tiny import TinyZoo

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TUNEPORT_CACHE_DIR", tempfile.mkdtemp(prefix="tuneport-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The vLLM servers tests start (child processes): a small KV cache and one OpenMP thread on these small machines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's CPU build binds that thread to the first core it may use (it reserves the others for its scheduler), the same
# core for every engine: under `make test`'s two workers, both workers' engines took turns on core 0 while core 1 held
# their schedulers (measured in CI: the vLLM module's shared job 211 s alone, 302 s beside another vLLM module). Each
# worker's engines get a core of their own.
if (_worker := os.environ.get("PYTEST_XDIST_WORKER", "")).startswith("gw") and hasattr(os, "sched_getaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    if len(_cores) >= 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cores[int(_worker[2:]) % len(_cores)]))
# torch's threads in this process: the cores shared among the xdist workers, one each under `make test`'s two. Two
# workers' torch teams of 2 threads on 2 cores spin at their barriers waiting for a thread the other worker's team holds
# off its core: measured on this module set (merge equivalence, MLX export, real configs), 150-175 s with 2 threads
# each, 73-92 s with 1.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))

ARCHS = ["llama", "mistral", "qwen2"]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> TinyZoo:
    return TinyZoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture
def ids() -> torch.Tensor:
    """A fixed token sequence inside every tiny vocabulary."""
    return torch.tensor([[1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]])


@pytest.fixture
def hub(zoo, tmp_path, monkeypatch):
    """A local Hugging Face cache holding the tiny llama as tiny-org/tiny-llama and an adapter as
    tiny-org/tiny-lora (offline: resolved exactly as a downloaded repo is)."""
    import huggingface_hub.constants

    for repo, src in (("tiny-llama", zoo.base("llama")), ("tiny-lora", zoo.adapter("llama", "plain"))):
        root = tmp_path / "hub" / f"models--tiny-org--{repo}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text("a" * 40)
        shutil.copytree(src, root / "snapshots" / ("a" * 40))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return "tiny-org/tiny-llama", "tiny-org/tiny-lora"


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``tuneport`` in-process; return (exit code, stdout, stderr)."""
    import contextlib
    import io

    from tuneport.toolkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def cli():
    return run_cli


SUMMARY = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def summary(request) -> list[str]:
    """Lines a test module wants at the end of the test output (the corpus count, the fuzzing budget)."""
    return request.config.stash.setdefault(SUMMARY, [])


def pytest_terminal_summary(terminalreporter, config):
    for line in dict.fromkeys(config.stash.get(SUMMARY, [])):
        terminalreporter.write_line(line)
    for line in config.stash[BUDGET].timing():
        terminalreporter.write_line(line)
    if slow := config.stash[BUDGET].over():
        terminalreporter.write_line(f"FAILED: the default run allows {DEFAULT_RUN_LIMIT_S:.0f} s per test (setup "
                                    "included); mark these slow or make them faster:", red=True)
        for line in slow:
            terminalreporter.write_line(f"  {line}", red=True)


# The default run (`pytest`, i.e. -m "not slow") has a budget: no test over this many seconds, its setup and
# teardown included (a module's shared fixtures count for its first test). Slower checks are marked slow (CI).
DEFAULT_RUN_LIMIT_S = 20.0


class DefaultRunBudget:
    """Seconds per test, added up on the process that reports them (the controller, under xdist)."""

    def __init__(self, config) -> None:
        self.config, self.seconds, self.worker_seconds = config, defaultdict(float), defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration
        if (node := getattr(report, "node", None)) is not None:  # xdist's controller: the worker that ran it
            self.worker_seconds[node.gateway.id] += report.duration

    def timing(self, top: int = 20) -> list[str]:
        """Where a run's time went: each worker's busy seconds (an idle tail shows as a gap between them) and the
        modules that took longest, setup and teardown included (LONGEST_FIRST is ordered by these)."""
        if not self.worker_seconds:
            return []
        modules: defaultdict[str, float] = defaultdict(float)
        for nodeid, s in self.seconds.items():
            modules[nodeid.split("::", 1)[0]] += s
        busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(self.worker_seconds.items()))
        longest = sorted(modules.items(), key=lambda kv: -kv[1])[:top]
        return [f"busy seconds per worker: {busy}", "longest modules: " + ", ".join(
            f"{Path(m).stem} {s:.0f}" for m, s in longest)]

    def over(self) -> list[str]:
        """Tests of the default selection that took over the limit, slowest first."""
        if self.config.getoption("markexpr") != "not slow" or hasattr(self.config, "workerinput"):
            return []
        over = sorted(((v, k) for k, v in self.seconds.items() if v > DEFAULT_RUN_LIMIT_S), reverse=True)
        return [f"{v:.1f}s {k}" for v, k in over]


BUDGET = pytest.StashKey[DefaultRunBudget]()


def pytest_sessionfinish(session):
    """An xdist worker hands its summary lines to the controller, which prints them; the default run fails when
    one of its tests took over DEFAULT_RUN_LIMIT_S."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["tuneport_summary"] = session.config.stash.get(SUMMARY, [])
    elif session.config.stash[BUDGET].over() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    node.config.stash.setdefault(SUMMARY, []).extend(getattr(node, "workeroutput", {}).get("tuneport_summary", []))


def pytest_configure(config):
    config.addinivalue_line("markers", "mlx: runs mlx-lm in this process (mlx[cpu] on Linux)")
    config.stash[BUDGET] = DefaultRunBudget(config)
    config.pluginmanager.register(config.stash[BUDGET], "tuneport-default-run-budget")


# The modules that take longest in CI (the "longest modules" line `make test` prints), run first: with `make test`'s
# two workers each module is one unit of work (xdist's reorder by test count is off), and starting the long ones
# first leaves short ones for the end.
LONGEST_FIRST = ("test_awq", "test_serve_ray", "test_vllm_export", "test_soak", "test_real_tokenizers", "test_faults",
                 "test_engine_faults", "test_real_configs", "test_real_model", "test_multimodal", "test_release",
                 "test_mlx_export", "test_serve_vllm", "test_hostile_clients", "test_api_docs", "test_exl3")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "vllm" in item.keywords or "llamacpp" in item.keywords:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept


def listdir(p: Path) -> list[str]:
    return sorted(x.name for x in p.iterdir())


@pytest.fixture(scope="session")
def upstream(tmp_path_factory):
    """llama.cpp's own converters, from the llama-cpp-python 0.3.36 sdist (skipped without the index)."""
    import os
    import subprocess
    import sys
    import tarfile

    tmp = tmp_path_factory.mktemp("llamacpp-src")
    res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                          "llama-cpp-python==0.3.36", "-d", str(tmp)], capture_output=True, text=True)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"), None)
    if res.returncode != 0 or sdist is None:
        pytest.skip(f"cannot download the llama-cpp-python sdist: {res.stderr.strip()[-200:]}")
    wanted = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(wanted)]
        tf.extractall(tmp, members=members, filter="data")
    src = next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))

    def convert(script: str, *args) -> None:
        env = {**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}:{src}"}
        done = subprocess.run([sys.executable, str(src / script), *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]

    return convert
