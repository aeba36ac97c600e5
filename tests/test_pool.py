"""The adapter pool: capacity, LRU, pinning, reference counts, on-demand loading, path rules."""

from __future__ import annotations

import threading
import time

import pytest
from tests_helpers import run_threads

from tuneport.serve.pool import AdapterPool, PoolError


class FakeEngine:
    """Records what the pool asks the engine to do (the pool is engine-agnostic)."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def load(self, name, path) -> int:
        with self.lock:
            assert name not in self.loaded
            self.loaded.add(name)
            self.log.append(("load", name))
        return 100

    def unload(self, name) -> None:
        with self.lock:
            self.loaded.remove(name)
            self.log.append(("unload", name))


def make_dirs(root, names):
    for n in names:
        (root / n).mkdir(parents=True)
        (root / n / "adapter_config.json").write_text("{}")
    return root


@pytest.fixture
def setup(tmp_path):
    eng = FakeEngine()
    ticks = iter(range(10_000))
    pool = AdapterPool(eng.load, eng.unload, max_adapters=2, adapter_dir=make_dirs(tmp_path / "ad", "abcde"),
                       clock=lambda: next(ticks), slot_wait_s=0.2)
    return pool, eng, tmp_path / "ad"


def test_lru_eviction_keeps_capacity(setup):
    pool, eng, root = setup
    pool.add("a", root / "a")
    pool.add("b", root / "b")
    with pool.use("a"):
        pass  # a is now more recent than b
    pool.add("c", root / "c")
    assert sorted(pool.names()) == ["a", "c"] and eng.loaded == {"a", "c"}
    assert pool.stats.evictions == 1 and ("unload", "b") in eng.log


def test_pinned_and_in_use_are_never_evicted(setup):
    pool, eng, root = setup
    pool.add("a", root / "a", pinned=True)
    pool.add("b", root / "b")
    with pool.use("b"):
        with pytest.raises(PoolError) as e:
            pool.add("c", root / "c")
        assert e.value.status == 503
        with pytest.raises(PoolError) as e:
            pool.remove("b")
        assert e.value.status == 409
    pool.add("c", root / "c")  # b is idle now
    assert sorted(pool.names()) == ["a", "c"]


def test_on_demand_load_and_404(setup, tmp_path):
    pool, eng, root = setup
    with pool.use("d") as entry:
        assert entry.refs == 1 and "d" in eng.loaded
    with pytest.raises(PoolError) as e, pool.use("zzz"):
        pass
    assert e.value.status == 404


def test_paths_and_names_are_checked(setup, tmp_path):
    pool, eng, root = setup
    outside = make_dirs(tmp_path / "elsewhere", ["x"]) / "x"
    for path, status in [(outside, 403), (root / ".." / "elsewhere" / "x", 403)]:
        with pytest.raises(PoolError) as e:
            pool.add("x", path)
        assert e.value.status == status
    with pytest.raises(PoolError) as e:
        pool.add("bad/name", root / "a")
    assert e.value.status == 400
    pool.add("x", outside, trusted=True)  # start-up paths are trusted
    assert "x" in pool


def test_concurrent_use_never_loses_an_adapter_in_use(tmp_path):
    eng = FakeEngine()
    root = make_dirs(tmp_path / "ad", [f"n{i}" for i in range(5)])
    pool = AdapterPool(eng.load, eng.unload, max_adapters=2, adapter_dir=root)
    errors = []

    def worker(k: int) -> None:
        for i in range(200):
            name = f"n{(k + i) % 5}"
            try:
                with pool.use(name):
                    assert name in eng.loaded
            except PoolError as e:  # requests wait for a slot: nothing may fail
                errors.append(e)
            except AssertionError as e:
                errors.append(e)

    run_threads(worker, [(k,) for k in range(4)])
    assert not errors
    assert len(eng.loaded) <= 2 and pool.stats.loads >= 5


def test_two_loads_of_one_name_waiting_for_a_full_pool_load_it_once(tmp_path):
    """Both wait for the only slot; when it frees, one loads and the other finds it loaded (409), instead
    of loading the name a second time over the first (which left requests on a replaced adapter)."""
    engine = FakeEngine()
    adapters = make_dirs(tmp_path, ["a", "b"])
    pool = AdapterPool(engine.load, engine.unload, 1, adapter_dir=adapters, slot_wait_s=10)
    with pool.use("a"):
        results: list[object] = []

        def add_b():
            try:
                results.append(pool.add("b", adapters / "b"))
            except PoolError as e:
                results.append(e.status)

        threads = [threading.Thread(target=add_b) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both are waiting for "a" to be released
    for t in threads:
        t.join(10)
    assert engine.log.count(("load", "b")) == 1
    assert sorted(map(str, results))[0] == "409" and pool.names() == ["b"]


def test_an_unload_the_engine_does_not_confirm_still_frees_the_slot(setup, caplog):
    """Seen in the vLLM soak: vLLM dropped the connection of an eviction's unload; the request needing the slot
    failed (500) and the adapter stayed loaded in vLLM but not in the pool. Now the eviction stands with a log
    line, and the engine's stale copy is the backend's to replace on the next load of that name."""
    pool, eng, root = setup

    def lost(name):
        raise ConnectionError("Server disconnected without sending a response.")

    pool.add("a", root / "a")
    pool.add("b", root / "b")
    pool._unload = lost
    with pool.use("c") as entry:  # evicts a; its unload is lost
        assert entry.name == "c"
    assert sorted(pool.names()) == ["b", "c"] and pool.stats.evictions == 1
    assert "adapter a evicted, but the engine did not confirm its unload" in caplog.text
    pool.remove("b")  # an admin unload: the same
    assert pool.names() == ["c"]


def test_pinned_adapters_filling_every_slot_are_not_a_retry_later(setup):
    """Slots held by pinned adapters free up only when one is unloaded: a load is refused (409) saying so, never
    told to retry; slots in use by requests (503) free up when the requests finish."""
    pool, eng, root = setup
    pool.add("a", root / "a", pinned=True)
    pool.add("b", root / "b", pinned=True)
    with pytest.raises(PoolError) as e, pool.use("c"):
        pass
    assert e.value.status == 409 and "retry" not in str(e.value).lower() + e.value.hint.lower()
    assert "all 2 adapter slots hold pinned adapters (a, b)" in str(e.value)
    assert "DELETE /v1/adapters/NAME" in e.value.hint


def test_serve_refuses_pinned_start_up_adapters_that_fill_the_pool_with_an_adapter_dir(cli, zoo, tmp_path):
    """Measured before: every on-demand load answered 503 'retry later' forever. Refused at start (exit 2)."""
    adapter = zoo.adapter("llama", "plain")
    args = ["serve", "--base", zoo.base("llama"), "--engine", "llamacpp", "--adapter-dir", tmp_path,
            "--adapter", f"a={adapter}", "--adapter", f"b={adapter}", "--max-adapters", "2", "--dry-run"]
    code, _, err = cli(*args)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "the 2 pinned start-up adapter(s) fill all --max-adapters 2 slots, so no on-demand load could ever " \
           "succeed" in err and "raise --max-adapters to at least 3, pass --no-pin" in err, err
    for fix in (["--max-adapters", "3"], ["--no-pin"]):
        code, _, err = cli(*args, *fix)
        assert code == 0, err
