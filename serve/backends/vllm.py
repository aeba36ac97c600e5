"""The vLLM backend: a vLLM child process, the adapter pool over its runtime LoRA API, and OpenAI requests
forwarded to it (the adapter held in the pool for the whole answer).

Every adapter passes tuneport's vLLM preflight before vLLM sees it (start-up ones too); adapters that
need a lossless fix (a regex ``target_modules``, ``fan_in_fan_out``, pickle weights, saved base layers
identical to the base) are rewritten once into the cache and vLLM gets the rewritten copy.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx

from tuneport.convert.adapter import load_adapter, resolve_adapter_path
from tuneport.convert.arch import arch_for
from tuneport.convert.awq.adapters import mark_rescaled, read_scales, rescale_adapter, rescaled_for, scales_digest
from tuneport.convert.cache import cache_dir, write_once
from tuneport.convert.checkpoint import Checkpoint, resolve_model_path
from tuneport.convert.errors import UserError
from tuneport.convert.export_vllm import VLLM_DTYPES, vllm_renamer, write_vllm_adapter
from tuneport.convert.hashing import content_digest
from tuneport.convert.merge import WeightedAdapter, plan_merge
from tuneport.convert.options import model_name
from tuneport.convert.vllm_rules import (
    VLLM_MAX_LORA_RANKS,
    preflight,
    round_lora_rank,
    vllm_config_updates,
    vllm_generation_updates,
)

from ..engines.hf_text import tokenizer_file_bound
from ..engines.vllm import VllmAdapters, VllmLaunch, VllmProcess, VllmRefused, check_extra_args
from ..pool import PoolError, check_name, resolve_inside
from ..tool_calls import syntax_in, template_of
from ..vllm_bugs import GUARD_ADAPTER, bugs_that_apply, vllm_platform, zero_adapter
from ..vllm_preflight import check_vllm_cpu
from .upstream import UpstreamBackend

log = logging.getLogger(__name__)
DEFAULT_LORA_RANK = 16  # vLLM's own default --max-lora-rank
ENGINE_DEAD_AFTER_S = 2.0  # vLLM's /health refusing (503, connection refused) this long: its engine is dead
ENGINE_STALLED_AFTER_S = 60.0  # vLLM's /health not answering at all this long (a busy API server is not dead)
HEALTH_PROBE_S = 5.0


def check_4bit_runs_here(ckpt: Checkpoint, dtype: str) -> None:
    """A 4-bit (W4A16) base on vLLM's CPU build: 16-bit activations only, and AVX-512 (else vLLM loads the
    model and dies at the first forward pass). Refused before vLLM starts."""
    from tuneport.convert.cpu_features import require_w4a16_cpu
    from tuneport.convert.stored.int4 import quant_info

    if not quant_info(ckpt.quantization or {}) or vllm_platform() != "cpu":
        return
    if dtype == "fp32":
        raise UserError(f"{ckpt.path} has 4-bit weights: vLLM's CPU W4A16 kernel has no fp32 path",
                        "drop --dtype fp32 (the model's own fp16/bf16 is used)")
    require_w4a16_cpu(ckpt.config)


def config_rank(adapter_dir: Path) -> int:
    """The largest rank an adapter declares (``r`` and ``rank_pattern``), 0 when unreadable."""
    try:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        return max([int(cfg.get("r") or 0), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def check_vllm_layout(ckpt: Checkpoint) -> None:
    """A checkpoint whose tensors vLLM would not find under their names (a multimodal tower as transformers 5
    saves it) is refused; tuneport's vLLM export writes the layout vLLM loads."""
    if vllm_renamer(ckpt) is not None:
        raise UserError(f"{ckpt.path.name} stores its {ckpt.model_type} vision tower as transformers 5 saves it, "
                        "which vLLM cannot load",
                        f"export it first (tuneport export --target vllm --base {ckpt.path} --out DIR writes the "
                        "hub's layout), then serve DIR/base")


class VllmPlan:
    """The launch decided from the options: checked adapters, rank, slots, the bug guard. With
    ``write=False`` (a dry run) nothing is written: fixed adapter copies and the guard adapter are only named."""

    def __init__(self, opts, write: bool = True) -> None:
        self.opts, self.write = opts, write
        self.ckpt = Checkpoint(resolve_model_path(opts.base))
        self.arch = arch_for(self.ckpt.model_type)
        self.name = model_name(opts.base)
        check_vllm_layout(self.ckpt)
        if write:
            check_4bit_runs_here(self.ckpt, opts.dtype)
            if vllm_platform() == "cpu":
                check_vllm_cpu(self.ckpt, opts)
        self.awq_scales = read_scales(self.ckpt.path)  # adapters over an AWQ base are rewritten with these
        self.awq_digest = scales_digest(self.ckpt.path) if self.awq_scales else None
        self.bugs = bugs_that_apply()
        self.guard = opts.vllm_base_guard == "on" or (opts.vllm_base_guard == "auto" and bool(self.bugs))
        # start-up adapters: where the user has them, and the directory vLLM loads (a fixed copy when needed)
        self.sources = {name: resolve_adapter_path(path) for name, path in opts.startup_adapters(must_fit=True).items()}
        self.max_lora_rank = self._max_lora_rank(self.sources)
        self.startup = {name: self.prepare(name, path) for name, path in self.sources.items()}
        extra = int(self.guard)
        slots = min(opts.max_loras or opts.max_adapters, opts.max_adapters)
        modules = dict(self.startup)
        if self.guard:
            modules[GUARD_ADAPTER] = zero_adapter(self.ckpt, self.arch, write=write)
        self.launch = VllmLaunch(
            model=str(self.ckpt.path), served_name=self.name, max_lora_rank=self.max_lora_rank,
            adapter_slots=slots + extra, registered=opts.max_adapters + extra,
            lora_modules={n: str(p) for n, p in modules.items()}, dtype=VLLM_DTYPES.get(opts.dtype),
            max_model_len=opts.max_model_len, tensor_parallel_size=opts.tensor_parallel_size,
            pipeline_parallel_size=opts.pipeline_parallel_size, extra_args=check_extra_args(opts.vllm_args),
            port=opts.engine_port or (opts.port + 1 if opts.port else 0),
            tool_parser=getattr(syntax_in(template_of(self.ckpt.path)), "name", None),
            hf_overrides=vllm_config_updates(self.ckpt.config),
            generation_overrides=vllm_generation_updates(self.ckpt.config))

    def _max_lora_rank(self, startup: dict[str, Path]) -> int:
        """``--max-lora-rank``: as given, else the largest rank among the start-up adapters and those in
        ``--adapter-dir`` (these only when vLLM can hold them), rounded up to vLLM's set."""
        opts = self.opts
        if opts.max_lora_rank is not None:
            if opts.max_lora_rank not in VLLM_MAX_LORA_RANKS:
                raise UserError(f"--max-lora-rank {opts.max_lora_rank} is not one vLLM accepts",
                                f"use one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}")
            return opts.max_lora_rank
        ranks = {name: config_rank(p) for name, p in startup.items()}
        for name, rank in ranks.items():
            if rank > VLLM_MAX_LORA_RANKS[-1]:
                raise UserError(f"adapter {name} has rank {rank}, above vLLM's largest "
                                f"--max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}",
                                "merge it (tuneport export --target vllm --adapters merge) or serve it with "
                                "--engine llamacpp")
        known = list(ranks.values())
        if opts.adapter_dir and opts.adapter_dir.is_dir():
            known += [r for p in opts.adapter_dir.iterdir() if (p / "adapter_config.json").exists()
                      and (r := config_rank(p)) <= VLLM_MAX_LORA_RANKS[-1]]
        top = max(known, default=0)
        return round_lora_rank(top) if top > DEFAULT_LORA_RANK else DEFAULT_LORA_RANK

    def prepare(self, name: str, path: Path) -> Path:
        """Preflight ``path`` for this base; the directory vLLM should load (a fixed copy when needed)."""
        check_name(name)
        if name in (GUARD_ADAPTER, self.name):
            raise PoolError(f"adapter name {name!r} is reserved", "pick another name", status=400)
        try:
            adapter = load_adapter(path, name)
            plan_merge(self.ckpt, [WeightedAdapter(adapter)])  # fits this base (names, shapes)
        except PoolError:
            raise
        except UserError as e:
            raise PoolError(e.message, e.hint, status=422) from e
        pf = preflight(adapter, self.arch, self.ckpt, self.max_lora_rank)
        if not pf.ok:
            raise PoolError(f"adapter {name} cannot be served by vLLM: " + "; ".join(pf.problems), "", status=422)
        awq = self._awq_rewrite(path)
        if not pf.fixes and awq is None:
            return Path(path).resolve()
        fixed = cache_dir() / "vllm-adapters" / (content_digest(Path(path)) + (f"-awq{awq}" if awq else ""))

        def write(tmp: Path) -> None:
            if awq is None:
                write_vllm_adapter(adapter, pf, tmp)
                return
            try:
                write_vllm_adapter(rescale_adapter(adapter, self.awq_scales), pf, tmp)
            except UserError as e:
                raise PoolError(e.message, e.hint, status=422) from e
            mark_rescaled(tmp, awq)

        return write_once(fixed, write) if self.write else fixed

    def _awq_rewrite(self, path: Path) -> str | None:
        """The AWQ base's scales digest when ``path`` must be rewritten for it (AWQ folded scales into the
        base, see convert.awq.adapters); None for other bases and adapters already rewritten for it."""
        if self.awq_digest is None or rescaled_for(Path(path)) == self.awq_digest:
            return None
        return self.awq_digest


class VllmBackend(UpstreamBackend):
    engine = "vllm"
    label = "vLLM"

    def __init__(self, plan: VllmPlan, log_path: Path | None = None, start_timeout_s: float = 900.0,
                 env: dict[str, str] | None = None) -> None:
        opts = plan.opts
        super().__init__(plan.name, opts.max_adapters, opts.adapter_dir)
        self.plan, self.guard = plan, plan.guard
        log_path = log_path or cache_dir() / "logs" / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{plan.launch.port}.log"
        self.process = VllmProcess(plan.launch, log_path, env)
        self.process.wait_healthy(start_timeout_s)  # stops it when it does not come up
        self.url = self.process.url
        self.admin = VllmAdapters(self.url)
        self._start_timeout_s, self._env = start_timeout_s, env
        self._unhealthy_since: tuple[str, float] | None = None  # how and when vLLM's /health began failing
        self._failure: str | None = None
        self._context = served_context(self.url)
        self._longest_token: int | None = None
        for name, path in plan.startup.items():  # the user's path (allowed for reloads), vLLM's copy's size
            self.pool.register(name, plan.sources[name], pinned=opts.pin, nbytes=_size(path))

    @classmethod
    def from_options(cls, opts) -> VllmBackend:
        return cls(VllmPlan(opts), log_path=opts.log_file)

    # -- adapters ------------------------------------------------------------------------------------
    def attach_adapter(self, name: str, path: Path) -> int:
        self._check_up()
        ready = self.plan.prepare(name, path)
        try:
            self.admin.load(name, ready)
        except VllmRefused as e:
            status = e.status if 400 <= e.status < 500 and e.status != 404 else 422
            raise PoolError(f"vLLM refused adapter {name!r}: {e.message}", "", status=status) from e
        return _size(ready)

    def detach_adapter(self, name: str) -> None:
        self.admin.unload(name)

    # -- requests ------------------------------------------------------------------------------------
    def upstream_model(self, model: str) -> str:
        """The vLLM model a request for ``model`` goes to (base traffic through the zero adapter)."""
        if model == self.name:
            return GUARD_ADAPTER if self.guard else self.name
        return model

    @property
    def prompt_token_limit(self) -> int | None:
        return self._context

    def longest_token_bytes(self) -> int | None:
        if self._longest_token is None:
            self._longest_token = tokenizer_file_bound(self.plan.ckpt.path / "tokenizer.json") or 0
        return self._longest_token or None

    # -- state ---------------------------------------------------------------------------------------
    def health(self) -> bool:
        return self.process.alive() and self._failure is None

    def failure(self) -> str | None:
        """vLLM's exit, or its engine dead behind a live API server (its /health refusing for
        ``ENGINE_DEAD_AFTER_S``: the first request on a model it cannot run kills its engine core; or not
        answering at all for ``ENGINE_STALLED_AFTER_S``), with the last error line of its log."""
        if self._failure is None:
            now = time.monotonic()
            state = self._vllm_health() if self.process.alive() else "exited"
            if state == "exited":
                self._failure = (f"vLLM exited with code {self.process.proc.returncode}: "
                                 f"{self.process.failure_line()}")
            elif state == "ok":
                self._unhealthy_since = None
            else:
                self._unhealthy_since = self._unhealthy_since or (state, now)
                kind, since = self._unhealthy_since
                if now - since >= (ENGINE_DEAD_AFTER_S if kind == "down" else ENGINE_STALLED_AFTER_S):
                    self._failure = f"vLLM's engine stopped answering: {self.process.failure_line()}"
        return self._failure

    def _vllm_health(self) -> str:
        """``ok``, ``down`` (vLLM answers that it is not healthy, or refuses the connection) or ``slow``."""
        try:
            return "ok" if httpx.get(f"{self.url}/health", timeout=HEALTH_PROBE_S).status_code == 200 else "down"
        except httpx.ConnectError:
            return "down"
        except httpx.HTTPError:
            return "slow"

    def restart(self) -> None:
        """A new vLLM child with the same launch (start-up adapters included), then the adapters loaded at
        runtime loaded again (each through the pool's path checks; one that no longer loads is dropped from the
        pool with a log line); requests meanwhile get 503."""
        self.process.stop()
        self.process = VllmProcess(self.plan.launch, self.process.log_path, self._env)
        self.process.wait_healthy(self._start_timeout_s)
        old, self.admin = self.admin, VllmAdapters(self.process.url)
        old.close()
        self.url = self.process.url
        self._unhealthy_since = self._failure = None
        self._context = served_context(self.url)
        for state in self.pool.states():
            name = state["name"]
            if name in self.plan.startup:
                continue
            try:
                self.attach_adapter(name, resolve_inside(state["path"], self.pool.allowed_roots))
            except Exception as e:  # noqa: BLE001 - that adapter is gone from the pool; the rest keeps serving
                log.warning("adapter %s was not loaded again after vLLM restarted: %s", name, e)
                self.pool.forget(name)

    def describe(self) -> dict:
        return {**super().describe(), "vllm_url": self.url, "base_guard": self.guard,
                "max_lora_rank": self.plan.max_lora_rank, "command": self.plan.launch.command()}

    def close(self) -> None:
        self.admin.close()
        self.process.stop()


def served_context(url: str) -> int | None:
    """The context vLLM serves its model with (``max_model_len`` in its ``/v1/models``); None if it does not say."""
    try:
        models = httpx.get(f"{url}/v1/models", timeout=HEALTH_PROBE_S).json()["data"]
        return max(int(m["max_model_len"]) for m in models if m.get("max_model_len"))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())
