"""What the gateway serves on the vLLM engine: a vLLM child process, the adapter pool over its runtime
LoRA API, and the upstream the gateway forwards OpenAI requests to.

Every adapter passes tuneport's vLLM preflight before vLLM sees it (start-up ones too); adapters that
need a lossless fix (a regex ``target_modules``, ``fan_in_fan_out``, pickle weights, saved base layers
identical to the base) are rewritten once into the cache and vLLM gets the rewritten copy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from convert.adapter import load_adapter
from convert.arch import arch_for
from convert.checkpoint import Checkpoint
from convert.errors import UserError
from convert.export_vllm import write_vllm_adapter
from convert.io import cache_dir, content_digest, write_once
from convert.merge import WeightedAdapter, plan_merge
from convert.vllm_rules import VLLM_MAX_LORA_RANKS, preflight, round_lora_rank

from .engines.vllm import VllmAdapters, VllmLaunch, VllmProcess, VllmRefused, check_extra_args
from .metrics import Metrics
from .pool import AdapterPool, PoolError, check_name
from .vllm_bugs import GUARD_ADAPTER, bugs_that_apply, zero_adapter

DEFAULT_LORA_RANK = 16  # vLLM's own default --max-lora-rank


@dataclass
class VllmOptions:
    base: str
    adapters: list[tuple[str, Path]] = field(default_factory=list)  # start-up adapters
    adapter_dir: Path | None = None
    max_adapters: int = 8
    pin: bool = True
    max_lora_rank: int | None = None  # None: the largest rank among the known adapters, rounded up
    max_loras: int | None = None  # adapters in one batch; None: max_adapters
    dtype: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    extra_args: list[str] = field(default_factory=list)
    guard: str = "auto"  # auto | on | off: base traffic as a zero adapter (see serve.vllm_bugs)
    port: int = 0
    served_name: str | None = None


def config_rank(adapter_dir: Path) -> int:
    """The largest rank an adapter declares (``r`` and ``rank_pattern``), 0 when unreadable."""
    try:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        return max([int(cfg.get("r") or 0), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


class VllmPlan:
    """The launch decided from the options: checked adapters, rank, slots, the bug guard."""

    def __init__(self, opts: VllmOptions) -> None:
        self.opts = opts
        if str(opts.base).endswith(".gguf"):
            raise UserError(f"--engine vllm serves Hugging Face safetensors models, not GGUF ({opts.base})",
                            "use --engine llamacpp for a GGUF base, or pass the HF model directory")
        self.ckpt = Checkpoint(opts.base)
        self.arch = arch_for(self.ckpt.model_type)
        self.name = opts.served_name or Path(str(opts.base)).name
        if opts.guard not in ("auto", "on", "off"):
            raise UserError(f"unknown --vllm-base-guard {opts.guard!r}", "use auto, on or off")
        self.bugs = bugs_that_apply()
        self.guard = opts.guard == "on" or (opts.guard == "auto" and bool(self.bugs))
        ranks = [config_rank(p) for _, p in opts.adapters]
        if opts.adapter_dir and opts.adapter_dir.is_dir():
            ranks += [config_rank(p) for p in opts.adapter_dir.iterdir() if (p / "adapter_config.json").exists()]
        if opts.max_lora_rank is not None:
            if opts.max_lora_rank not in VLLM_MAX_LORA_RANKS:
                raise UserError(f"--max-lora-rank {opts.max_lora_rank} is not one vLLM accepts",
                                f"use one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}")
            self.max_lora_rank = opts.max_lora_rank
        else:
            top = max(ranks, default=0)
            self.max_lora_rank = round_lora_rank(top) if top > DEFAULT_LORA_RANK else DEFAULT_LORA_RANK
        self.startup = {}
        for name, path in opts.adapters:
            self.startup[name] = self.prepare(name, path)
        extra = int(self.guard)
        slots = min(opts.max_loras or opts.max_adapters, opts.max_adapters)
        modules = dict(self.startup)
        if self.guard:
            modules[GUARD_ADAPTER] = str(zero_adapter(self.ckpt, self.arch))
        self.launch = VllmLaunch(
            model=str(self.ckpt.path), served_name=self.name, max_lora_rank=self.max_lora_rank,
            adapter_slots=slots + extra, registered=opts.max_adapters + extra,
            lora_modules={n: str(p) for n, p in modules.items()}, dtype=opts.dtype,
            max_model_len=opts.max_model_len, tensor_parallel_size=opts.tensor_parallel_size,
            pipeline_parallel_size=opts.pipeline_parallel_size, extra_args=check_extra_args(list(opts.extra_args)),
            port=opts.port)

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
        if not pf.fixes:
            return Path(path).resolve()
        return write_once(cache_dir() / "vllm-adapters" / content_digest(Path(path)),
                          lambda tmp: write_vllm_adapter(adapter, pf, tmp))


class VllmService:
    proxied = True

    def __init__(self, opts: VllmOptions, log_path: Path | None = None, start_timeout_s: float = 900.0,
                 env: dict[str, str] | None = None) -> None:
        self.plan = plan = VllmPlan(opts)
        self.name, self.guard = plan.name, plan.guard
        log_path = log_path or cache_dir() / "logs" / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{plan.launch.port}.log"
        self.process = VllmProcess(plan.launch, log_path, env)
        try:
            self.process.wait_healthy(start_timeout_s)
        except BaseException:
            self.process.stop()
            raise
        self.url = self.process.url
        self.admin = VllmAdapters(self.url)
        self.pool = AdapterPool(self._load, self._unload, opts.max_adapters, opts.adapter_dir)
        for name, path in opts.adapters:
            self.pool.register(name, path, pinned=opts.pin, nbytes=_size(plan.startup[name]))
        self.metrics = Metrics()
        self.created = int(time.time())

    def _load(self, name: str, path: Path) -> int:
        ready = self.plan.prepare(name, path)
        try:
            self.admin.load(name, ready)
        except VllmRefused as e:
            status = e.status if 400 <= e.status < 500 and e.status != 404 else 422
            raise PoolError(f"vLLM refused adapter {name!r}: {e.message}", "", status=status) from e
        return _size(ready)

    def _unload(self, name: str) -> None:
        self.admin.unload(name)

    def upstream_model(self, model: str) -> str:
        """The vLLM model a request for ``model`` goes to (base traffic through the zero adapter)."""
        if model == self.name:
            return GUARD_ADAPTER if self.guard else self.name
        return model

    def healthy(self) -> bool:
        return self.process.alive()

    def close(self) -> None:
        self.admin.close()
        self.process.stop()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())
