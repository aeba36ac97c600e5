"""ExLlamaV3 behind the gateway: TabbyAPI (its OpenAI server, AGPL: the user's checkout, never vendored) as a
child process serving one EXL3 directory, with the same hygiene as vLLM (own process group, log, health).

TabbyAPI's exllamav3 backend loads no LoRA (``load_loras`` is a stub) and ExLlamaV3 applies a loaded LoRA to
every request, so this engine serves adapters merged: one EXL3 per fine-tune (``export --target exl3``).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from tuneport.convert.checkpoint import resolve_model_path
from tuneport.convert.errors import UserError
from tuneport.convert.exl3.converter import requirements
from tuneport.convert.exl3.tabby import LAUNCH, tabby_config, write_tabby_config
from tuneport.convert.io import cache_dir
from tuneport.convert.options import model_name

from .engines.child import ChildServer, free_port
from .pool import PoolError
from .upstream import UpstreamBackend

log = logging.getLogger(__name__)
NO_LORA = ("ExLlamaV3 (TabbyAPI) serves no LoRA adapters: TabbyAPI's exllamav3 backend does not load them and "
           "ExLlamaV3 applies a loaded LoRA to every request")
MERGE_HINT = "merge each fine-tune into its own EXL3 (tuneport export --target exl3 --adapter PATH) and serve that"
TABBY_HINT = ("clone TabbyAPI (git clone https://github.com/theroyallab/tabbyAPI), install its requirements and "
              "exllamav3 in this environment, then pass --tabby-dir DIR")


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
        raise UserError("ExLlamaV3 needs a CUDA GPU and this machine has none",
                        "serve a GGUF export with --engine llamacpp here, or run this on an NVIDIA GPU host")
    return tabby


class ExllamaV3Backend(UpstreamBackend):
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
    def check_options(cls, opts, fmt: str) -> None:
        if opts.adapters or opts.adapter_dir:
            raise UserError(NO_LORA, MERGE_HINT)

    @classmethod
    def from_options(cls, opts) -> ExllamaV3Backend:
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
