"""Small HTTP pieces shared by the gateway, the backends and the engine launchers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
from fastapi.responses import JSONResponse


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI/vLLM-style error response (``{"error": {"message"}}``, ``detail``, or text)."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or body)
    return str(err)


def wait_for_health(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True,
                    headers: dict[str, str] | None = None, interval_s: float = 0.5) -> bool:
    """Poll ``url``/health until it answers 200 (True); False on timeout or once ``alive()`` turns False."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def dumps(obj) -> str:
    """Compact JSON, as the OpenAI API sends it."""
    return json.dumps(obj, separators=(",", ":"))


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj``."""
    return f"data: {dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
