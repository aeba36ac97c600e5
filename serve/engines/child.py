"""An engine's OpenAI server as tuneport's child process: its own process group (stopped as a whole), SIGTERM
when tuneport dies, its log captured, its health awaited, its last error line at hand (vLLM, TabbyAPI)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tuneport.convert.errors import UserError

from ..http import wait_for_health

STOP_TIMEOUT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ChildServer:
    """One engine server started from ``command`` (in ``cwd``), answering on ``url``, logging to ``log_path``."""

    def __init__(self, label: str, command: list[str], url: str, log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None, unset_env_prefix: str | None = None) -> None:
        self.label, self.url, self.log_path = label, url, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        inherited = {k: v for k, v in os.environ.items() if not (unset_env_prefix and k.startswith(unset_env_prefix))}
        self.proc = subprocess.Popen(command, env={**inherited, **(env or {})}, cwd=cwd, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_alive(self) -> bool:
        """Whether any process of the child's group (vLLM: server, engine core, workers) still exists."""
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def log_tail(self, n: int = 40) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []

    def failure_line(self) -> str:
        """The most telling line of the log: the last error, else the last line."""
        tail = self.log_tail(200)
        errors = [x for x in tail if "Error" in x or "error" in x]
        return (errors or tail or ["(empty log)"])[-1].strip()[:300]

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Return once /health answers 200; otherwise (it exited, timed out, or the wait was interrupted)
        stop the whole group and raise."""
        try:
            if wait_for_health(self.url, timeout_s, alive=self.alive):
                return
            if not self.alive():
                raise UserError(f"{self.label} exited with code {self.proc.returncode} while starting: "
                                f"{self.failure_line()}", f"see its log {self.log_path}")
            raise UserError(f"{self.label} did not become healthy within {timeout_s:.0f} s",
                            f"see its log {self.log_path}")
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the whole process group (vLLM's engine core included), SIGKILL what is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        deadline = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            self._log.close()
        atexit.unregister(self.stop)
