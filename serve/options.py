"""``tuneport serve``'s options: one model for the CLI and the Python API (``tuneport.serve``)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.gpu import parse_gpu_layers
from tuneport.convert.options import DTYPES, AdapterSpec, check_choice, model_name

from .limits import LIMIT_FLAGS, HttpLimits
from .pool import check_name
from .registry import ENGINES, option_flag

BASE_GUARD = ("auto", "on", "off")
PLACES = ("local", "ray")  # --on: one process here, or a Ray Serve application (tuneport.serve.rayserve)
RAY_ONLY = ("ray_address", "deploy_dir", "min_replicas", "max_replicas", "target_ongoing_requests", "cpus_per_replica",
            "upscale_delay_s", "downscale_delay_s")


def parse_named(specs: list[str] | dict[str, str | Path]) -> dict[str, str]:
    """``NAME=PATH`` specs (or a ``{name: path}`` dict) as ``{name: path}``; a bare PATH is named after
    it (``model_name``). PATH may be a hub id. Weights (``PATH:WEIGHT``) belong to merges: refused here."""
    if isinstance(specs, dict):
        parsed = [AdapterSpec(Path(v).expanduser(), 1.0, str(k)) for k, v in specs.items()]
    else:
        parsed = [AdapterSpec.parse(str(spec)) for spec in specs]
    out: dict[str, str] = {}
    for a in parsed:
        name = a.name or model_name(a.path)
        if a.weight != 1.0:
            raise UserError(f"adapter {name} has a weight ({a.weight:g}): weights apply when merging",
                            "serve NAME=PATH, and mix adapters per request with 'adapters' (llama.cpp)")
        if check_name(name) in out:
            raise UserError(f"two adapters are named {name!r}", "give each --adapter its own NAME=")
        out[name] = str(a.path)
    return out


@dataclass(kw_only=True)
class ServeOptions:
    """Everything ``tuneport serve`` takes. Engine-specific options are refused by the other engine."""

    base: str | Path  # GGUF file, HF model directory or hub id
    adapters: dict[str, str] | list[str] = field(default_factory=dict)  # name -> PEFT dir / GGUF LoRA / hub id
    adapter_dir: Path | None = None  # adapters loaded on demand as DIR/<name>
    engine: str = "auto"
    max_adapters: int = 8
    pin: bool = True  # start-up adapters are never evicted
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the Python API's Server.url tells which)
    api_key_file: Path | None = None
    admin_key_file: Path | None = None  # the admin API's own key; None: the API key guards it too
    max_tokens_limit: int | None = None  # the most max_tokens a request may ask for (400 above)
    max_concurrent_per_key: int | None = None  # generation requests in flight per key (429 above)
    # what a client may send or hold open (serve.limits.HttpLimits; every engine)
    max_body_bytes: int = HttpLimits.max_body_bytes  # 413 above, Content-Length or chunked alike
    body_timeout_s: float = HttpLimits.body_timeout_s  # the whole body within this (408)
    max_header_bytes: int = HttpLimits.max_header_bytes  # request line and headers (431 above)
    header_timeout_s: float = HttpLimits.header_timeout_s  # a new connection's request headers within this
    idle_timeout_s: float = HttpLimits.idle_timeout_s  # the next request on a connection within this
    send_timeout_s: float = HttpLimits.send_timeout_s  # a client reading nothing of its answer this long: dropped
    max_connections: int = HttpLimits.max_connections  # connections open; the longest-idle closed to make room
    concurrency: int = 8  # expected simultaneous requests: engine choice and memory plan
    dtype: str = "auto"  # vLLM: model dtype; llama.cpp / MLX with an HF base: the model it converts to
    # llama.cpp and MLX
    n_ctx: int = 2048  # tokens per request (prompt + output)
    max_prompt_tokens: int | None = None  # the longest prompt in tokens (400 above)
    # llama.cpp
    contexts: int = 1  # the most llama.cpp contexts the decode loop creates (adapter sets each on their own)
    max_sets_per_batch: int | None = None  # llama.cpp: distinct adapter sets in one decode batch (None: 8, measured)
    prompt_cache: bool = True  # keep finished sequences' KV cells for reuse under the same adapter set
    kv_f32: bool = False  # F32 KV cache: transformers' fp32 numbers, twice the memory of F16
    threads: int | None = None  # llama.cpp's threads (None: the physical cores; on Ray: --cpus-per-replica)
    gpu_layers: int | str | None = None  # layers in VRAM: "all", N, or None (all on a GPU build of llama.cpp, else 0)
    # vLLM
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_lora_rank: int | None = None  # None: the largest adapter rank, rounded up to vLLM's set
    max_loras: int | None = None  # adapters in one batch; None: max_adapters
    engine_port: int | None = None  # vLLM's (TabbyAPI's) own port on 127.0.0.1; None: port + 1 (a free one)
    vllm_base_guard: str = "auto"  # base traffic as a zero adapter where vLLM's CPU bug applies
    log_file: Path | None = None  # vLLM's (TabbyAPI's) log; None: in the cache
    restart_engine: bool = False  # vLLM died under the gateway: start it again (else serve exits 1)
    vllm_args: list[str] = field(default_factory=list)  # passed to vLLM as they are
    # ExLlamaV3
    tabby_dir: Path | None = None  # a TabbyAPI checkout (its main.py), run as the engine's server
    # Several replicas: on Ray Serve (--on ray), or commands plus an nginx upstream (--dry-run without Ray)
    on: str = "local"  # "ray": a Ray Serve application, requests routed to a replica holding their adapter
    ray_address: str | None = None  # a running Ray cluster ("auto", "ray://HOST:10001", ...); None: start one here
    replicas: int = 1  # Ray: fixed replicas (unless --min/--max-replicas autoscale); nginx dry run: commands
    min_replicas: int | None = None  # Ray autoscaling: fewest replicas
    max_replicas: int | None = None  # Ray autoscaling: most replicas
    target_ongoing_requests: float = 2.0  # Ray autoscaling: requests in flight per replica it aims for
    cpus_per_replica: float = 1.0  # Ray: CPUs each replica reserves (its llama.cpp threads, at least 1)
    gpus_per_replica: float | None = None  # Ray: GPUs each replica reserves (None: 0); nginx dry run: 1
    deploy_dir: Path | None = None  # --dry-run --on ray: the Serve config and KubeRay manifest (./tuneport-ray)
    upscale_delay_s: float = 10.0  # Ray autoscaling: load above target this long adds a replica
    downscale_delay_s: float = 60.0  # Ray autoscaling: load below target this long removes one

    def __post_init__(self) -> None:
        self._check_places()
        self._post_init()

    def _check_places(self) -> None:
        check_choice("--on", self.on, PLACES)
        given = self.changed()
        if self.on != "ray" and (ray := [k for k in RAY_ONLY if k in given]):
            raise UserError(f"{option_flag(ray[0])} applies to --on ray", "add --on ray, or drop it")
        if self.replicas < 1:
            raise UserError(f"--replicas {self.replicas}: must be at least 1", "")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise UserError(f"--gpus-per-replica {self.gpus_per_replica:g}: must not be negative", "")
        if self.cpus_per_replica <= 0:
            raise UserError(f"--cpus-per-replica {self.cpus_per_replica:g}: must be above 0", "")
        if min(self.upscale_delay_s, self.downscale_delay_s) < 0:
            raise UserError("--upscale-delay and --downscale-delay must not be negative", "")
        if self.target_ongoing_requests <= 0:
            raise UserError(f"--target-ongoing-requests {self.target_ongoing_requests:g}: must be above 0", "")
        if self.on == "ray" and self.adapter_dir is not None and not Path(self.adapter_dir).expanduser().is_dir():
            raise UserError(f"--adapter-dir {self.adapter_dir} is not a directory",
                            "pass a directory every Ray node can read at that path")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise UserError("--min-replicas and --max-replicas go together (autoscaling)",
                            "give both, or --replicas N for a fixed number")
        if self.min_replicas is not None:
            if "replicas" in given:
                raise UserError("--replicas is a fixed number; --min-replicas/--max-replicas autoscale",
                                "give one or the other")
            if not 1 <= self.min_replicas <= self.max_replicas:
                raise UserError(f"--min-replicas {self.min_replicas} --max-replicas {self.max_replicas}: need "
                                "1 <= min <= max", "the ingress asks a replica what it serves, so at least one runs")

    def _post_init(self) -> None:
        self.base = str(self.base)
        self.deploy_dir = Path(self.deploy_dir).expanduser() if self.deploy_dir else None
        self.adapters = parse_named(self.adapters)
        self.adapter_dir = Path(self.adapter_dir).expanduser() if self.adapter_dir else None
        self.api_key_file = Path(self.api_key_file) if self.api_key_file else None
        self.admin_key_file = Path(self.admin_key_file) if self.admin_key_file else None
        self.log_file = Path(self.log_file) if self.log_file else None
        self.tabby_dir = Path(self.tabby_dir).expanduser() if self.tabby_dir else None
        self.vllm_args = list(self.vllm_args)
        self.gpu_layers = parse_gpu_layers(self.gpu_layers)
        check_choice("--engine", self.engine, ("auto", *ENGINES))
        check_choice("--dtype", self.dtype, DTYPES)
        check_choice("--vllm-base-guard", self.vllm_base_guard, BASE_GUARD)
        if self.max_adapters < 1:
            raise UserError("--max-adapters must be at least 1", "")
        self.check_on_demand_room()
        if self.max_sets_per_batch is not None and self.max_sets_per_batch < 1:
            raise UserError(f"--max-sets-per-batch {self.max_sets_per_batch}: must be at least 1",
                            "leave it out for the measured default")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads {self.threads}: must be at least 1", "leave it out for the physical cores")
        if self.contexts < 1:
            raise UserError("--contexts must be at least 1", "1 keeps every adapter set in one context")
        for limit in ("max_tokens_limit", "max_prompt_tokens", "max_concurrent_per_key"):
            if getattr(self, limit) is not None and getattr(self, limit) < 1:
                raise UserError(f"{option_flag(limit)} must be at least 1", "leave it out for no limit")
        self.http_limits()  # checked now: a bad limit is exit 2 before anything starts

    def http_limits(self) -> HttpLimits:
        """What a client may send or hold open (the body's limits are the gateway's, the rest the server's)."""
        return HttpLimits(**{name: getattr(self, name) for name in LIMIT_FLAGS})

    def changed(self) -> dict[str, object]:
        """The options set to something other than their default (the fields a user actually gave)."""
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                    for f in fields(self) if f.default is not MISSING or f.default_factory is not MISSING}
        return {k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v}

    def startup_adapters(self, must_fit: bool) -> dict[str, str]:
        """The start-up adapters; refused when they must all stay loaded but exceed the pool."""
        if must_fit and len(self.adapters) > self.max_adapters:
            raise UserError(f"{len(self.adapters)} start-up adapters exceed --max-adapters {self.max_adapters}",
                            "raise --max-adapters (or pass --no-pin on the llama.cpp engine)")
        return dict(self.adapters)

    def check_on_demand_room(self) -> None:
        """``--adapter-dir`` loads adapters on demand into free slots: refused when pinned start-up adapters fill
        every slot, since no load could ever succeed."""
        if self.adapter_dir is not None and self.pin and self.adapters and len(self.adapters) >= self.max_adapters:
            raise UserError(f"--adapter-dir loads adapters on demand, but the {len(self.adapters)} pinned start-up "
                            f"adapter(s) fill all --max-adapters {self.max_adapters} slots, so no on-demand load "
                            "could ever succeed",
                            f"raise --max-adapters to at least {len(self.adapters) + 1}, pass --no-pin (start-up "
                            "adapters may then be evicted), or drop --adapter-dir")

    def read_api_key(self) -> str | None:
        return read_key_file("--api-key-file", self.api_key_file)

    def gateway_settings(self) -> dict:
        """The gateway's keys and limits (``create_app``'s keywords); the key files are read here, so an
        unusable one is refused before the engine starts."""
        key, admin = self.read_api_key(), read_key_file("--admin-key-file", self.admin_key_file)
        if key is not None and key == admin:
            raise UserError(f"--admin-key-file {self.admin_key_file} holds the same key as --api-key-file",
                            "give the admin API a key of its own")
        return {"api_key": key, "admin_key": admin, "max_tokens_limit": self.max_tokens_limit,
                "max_concurrent_per_key": self.max_concurrent_per_key, "limits": self.http_limits()}


def read_key_file(flag: str, path: Path | None) -> str | None:
    """The key in ``path``: one line (surrounding whitespace dropped); refused when unreadable, empty or
    longer than one line."""
    if path is None:
        return None
    try:
        key = path.read_text(encoding="utf-8-sig").strip()  # a byte-order mark is not part of the key
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise UserError(f"cannot read {flag} {path} ({why})", "pass a readable file") from e
    if not key:
        raise UserError(f"{flag} {path} is empty", "write the key into it")
    if "\n" in key or "\r" in key:
        raise UserError(f"{flag} {path} holds more than one line", "write the key alone on one line")
    return key
