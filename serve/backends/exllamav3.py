"""ExLlamaV3 behind the gateway, two ways over one EXL3 directory:

- in this process (default): exllamav3's Model, paged Cache and Generator driven by :class:`Exl3Engine`, with
  PEFT adapters loaded at run time (exllamav3's ``LoRA``, each adapter rewritten first by
  :mod:`tuneport.convert.exl3.adapter` so it applies exactly as PEFT does) and switched between batches;
- through TabbyAPI (``--tabby-dir``, its OpenAI server, AGPL: the user's checkout, never vendored) as a child
  process, adapter-less, with the same hygiene as vLLM (own process group, log, health).

Adapters need the in-process engine: TabbyAPI's exllamav3 backend loads no LoRA (its ``load_loras`` is a stub)
and exllamav3 applies every registered LoRA to every request, so only code that owns the generator can give each
request its own adapter. TabbyAPI stays for users who want its server (its own samplers, JSON-schema filters,
tool-call handling) over a base or a merged EXL3.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tuneport.convert.cache import cache_dir
from tuneport.convert.checkpoint import resolve_model_path
from tuneport.convert.errors import UserError
from tuneport.convert.exl3.converter import requirements
from tuneport.convert.exl3.tabby import LAUNCH, round_cache, tabby_config, write_tabby_config
from tuneport.convert.options import model_name

from ..engines.base import Event, GenerationRequest
from ..engines.child import ChildServer, free_port
from ..pool import PoolError
from .inprocess import InProcessBackend
from .upstream import UpstreamBackend

log = logging.getLogger(__name__)
NO_LORA = ("TabbyAPI (--tabby-dir) serves no LoRA adapters: its exllamav3 backend does not load them and "
           "ExLlamaV3 applies a loaded LoRA to every request")
MERGE_HINT = ("drop --tabby-dir: tuneport's in-process ExLlamaV3 engine serves adapters over the EXL3 base "
              "(or merge each fine-tune into its own EXL3: tuneport export --target exl3 --adapter PATH)")
TABBY_HINT = ("clone TabbyAPI (git clone https://github.com/theroyallab/tabbyAPI), install its requirements and "
              "exllamav3 in this environment, then pass --tabby-dir DIR")
NO_CUDA_HINT = "serve a GGUF export with --engine llamacpp here, or run this on an NVIDIA GPU host"


def check_runtime() -> None:
    """exllamav3 installed and a CUDA GPU visible; refused with the reason otherwise."""
    req = requirements()
    if not req.cuda:
        raise UserError("ExLlamaV3 needs a CUDA GPU and this machine has none", NO_CUDA_HINT)
    if not req.exllamav3:
        raise UserError("ExLlamaV3 (--engine exllamav3) is not installed here",
                        "on this CUDA host: pip install exllamav3 (its extension compiles with nvcc at first import)")


def tabby_launch(tabby_dir: Path, config: Path) -> list[str]:
    """TabbyAPI's command: its main.py with the config tuneport wrote (run in its checkout)."""
    python = tabby_dir / "venv" / "bin" / "python"  # its start script's environment, when there is one
    return [str(python if python.exists() else Path(sys.executable)), "main.py", "--config", str(config)]


def engine_port(opts) -> int:
    """TabbyAPI's port: ``--engine-port``, else the gateway's + 1 (as vLLM's), else a free one."""
    return opts.engine_port or (opts.port + 1 if opts.port else free_port())


def check_tabby(opts) -> Path:
    """The TabbyAPI checkout to run, and a CUDA GPU to run it on; refused with the reason otherwise."""
    if opts.tabby_dir is None:
        raise UserError("--engine exllamav3 runs TabbyAPI, which tuneport does not ship (AGPL)", TABBY_HINT)
    tabby = Path(opts.tabby_dir).expanduser()
    if not (tabby / "main.py").is_file():
        raise UserError(f"--tabby-dir {tabby} is not a TabbyAPI checkout (no main.py)", TABBY_HINT)
    if not requirements().cuda:
        raise UserError("ExLlamaV3 needs a CUDA GPU and this machine has none", NO_CUDA_HINT)
    return tabby


class TabbyBackend(UpstreamBackend):
    engine = "exllamav3"
    label = "TabbyAPI"

    def __init__(self, opts, start_timeout_s: float = 900.0) -> None:
        tabby = check_tabby(opts)
        model = resolve_model_path(opts.base)
        super().__init__(model_name(opts.base), 1, None)
        self.served_as = model.name  # TabbyAPI names the model after its directory
        port = engine_port(opts)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{port}"
        self.config_path = write_tabby_config(cache_dir() / "tabby" / f"config-{stamp}.yml", tabby_config(
            model, opts.n_ctx, cache_size=opts.n_ctx * opts.concurrency, host="127.0.0.1", port=port))
        self.command = tabby_launch(tabby, self.config_path)
        log_path = opts.log_file or cache_dir() / "logs" / f"tabby-{stamp}.log"
        if (tabby / "config.yml").is_file():
            log.warning("%s/config.yml exists: TabbyAPI reads it before tuneport's config, so keys tuneport does "
                        "not set there (lora, draft_model, gpu_split, ...) still apply", tabby)
        self.process = ChildServer(self.label, self.command, f"http://127.0.0.1:{port}", log_path, cwd=tabby,
                                   unset_env_prefix="TABBY_")  # TabbyAPI's env overrides would beat the config
        self.process.wait_healthy(start_timeout_s)  # stops it when it does not come up
        self.url = self.process.url

    @classmethod
    def from_options(cls, opts) -> TabbyBackend:
        return cls(opts)

    def attach_adapter(self, name: str, path: Path) -> int:
        raise PoolError(NO_LORA, MERGE_HINT, status=422)

    def detach_adapter(self, name: str) -> None:  # nothing is ever attached
        pass

    def upstream_model(self, model: str) -> str:
        return self.served_as

    def whole_answer_body(self, body: dict) -> dict:
        # TabbyAPI reports usage only when stream_options.include_usage is set, streamed or not
        return {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}

    def health(self) -> bool:
        return self.process.alive() and self._failure is None

    def failure(self) -> str | None:
        if self._failure is None and not self.process.alive():
            self._failure = f"TabbyAPI exited with code {self.process.proc.returncode}: {self.process.failure_line()}"
        return self._failure

    def describe(self) -> dict:
        return {**super().describe(), "tabby_url": self.url, "tabby_config": str(self.config_path),
                "command": self.command, "launch": LAUNCH.format(config=self.config_path)}

    def close(self) -> None:
        self.process.stop()


class ExllamaV3Backend(InProcessBackend):
    """ExLlamaV3 in this process, adapters at run time (see the module); ``--tabby-dir`` starts a
    :class:`TabbyBackend` instead."""

    engine = "exllamav3"

    def __init__(self, base: str | Path, *, max_adapters: int = 8, adapter_dir: Path | None = None,
                 n_ctx: int = 2048, cache_tokens: int = 16384) -> None:
        from tuneport.convert.exl3.read import Exl3Model

        from ..engines.exllamav3 import Exl3Engine
        from ..engines.hf_text import HfText

        check_runtime()
        self.model_dir = resolve_model_path(base)
        self.exl3 = Exl3Model(self.model_dir)  # refuses a directory that is not EXL3, before the GPU is touched
        self.text = HfText(_hf_tokenizer(self.model_dir))
        self.chat_template = self.text.chat_template
        self.exl = Exl3Engine(self.model_dir, n_ctx=n_ctx, cache_tokens=cache_tokens)
        try:
            super().__init__(model_name(base), max_adapters, adapter_dir)
        except BaseException:
            self.exl.close()
            raise

    @classmethod
    def check_options(cls, opts, fmt: str) -> None:
        if opts.tabby_dir is not None and (opts.adapters or opts.adapter_dir):
            raise UserError(NO_LORA, MERGE_HINT)
        if opts.tabby_dir is None and (opts.engine_port or opts.log_file):
            raise UserError("--engine-port and --log-file belong to TabbyAPI (--tabby-dir)",
                            "drop them: the in-process ExLlamaV3 engine has no server of its own")

    @classmethod
    def from_options(cls, opts) -> InProcessBackend | TabbyBackend:
        if opts.tabby_dir is not None:
            return TabbyBackend(opts)
        return cls.start(opts, n_ctx=opts.n_ctx, cache_tokens=round_cache(opts.n_ctx * opts.concurrency))

    # -- adapters ------------------------------------------------------------------------------------
    def attach_adapter(self, name: str, path: Path) -> int:
        from tuneport.convert.exl3.adapter import cached_exl3_adapter

        try:
            rewritten, lora = cached_exl3_adapter(path, self.exl3, name)
            for note in lora.notes:
                log.info("adapter %s: %s", name, note)
            return self.exl.load_adapter(name, rewritten)
        except UserError as e:
            raise PoolError(e.message, e.hint, status=422) from e

    def detach_adapter(self, name: str) -> None:
        self.exl.unload_adapter(name)

    # -- requests ------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.text.encode(text, special=add_bos is not False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, bool]:
        return self.text.chat(messages), False

    @property
    def vocab_size(self) -> int:
        return self.exl.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.exl.n_ctx

    def token_bytes_bound(self) -> int:
        return self.text.token_bytes_bound()

    def piece(self, token: int) -> bytes:
        return self.text.piece(token)

    def run(self, request: GenerationRequest) -> Iterator[Event]:
        return self.exl.events(request)

    # -- state ---------------------------------------------------------------------------------------
    def health(self) -> bool:
        return self.exl.alive()

    def describe(self) -> dict:
        return {**super().describe(), "exl3_model": str(self.model_dir), "n_ctx": self.exl.n_ctx,
                "cache_tokens": self.exl.cache_tokens, "max_batch": self.exl.max_batch,
                "adapter_set_switches": self.exl.turns.switches, "fast_paths": self.exl.fast.describe()}

    def close(self) -> None:
        self.exl.close()


def _hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
