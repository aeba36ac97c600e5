"""The connection limits of ``tuneport serve``'s own HTTP server: uvicorn's HTTP protocol (httptools or h11) held to
:class:`~tuneport.serve.limits.HttpLimits`, however a client frames or paces what it sends.

- **Headers**: the request line and headers within ``max_header_bytes`` (431) and, on a new connection, within
  ``header_timeout_s`` (408 when part of a request came, else closed): one byte a second holds nothing.
- **Between requests**: after an answer the next request must begin within ``idle_timeout_s``; the rest of a
  body refused early (413) is read and dropped meanwhile, so the client reads its answer instead of a reset, but
  no longer than that.
- **Slow readers**: a client that reads nothing of its answer for ``send_timeout_s`` is disconnected (its stream
  is cancelled and its sequences freed); until then uvicorn's flow control holds the answer back: at most 64 KiB
  in the process and the kernel's send buffer (``SEND_BUFFER_BYTES``) per connection.
- **Connections**: at most ``max_connections`` open; a new one past that closes the longest-idle connections
  (no request in progress) to make room, and only when every one is busy is it refused (503).

Both of uvicorn's HTTP implementations hold them: httptools (llhttp) where it is installed, h11 otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11 serves alone
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from tuneport.convert.errors import UserError

from ..limits import HttpLimits

log = logging.getLogger("tuneport.serve")
SPARE_FDS = 64  # file descriptors beside the connections: the engine, its files, vLLM's connections, logs
SEND_BUFFER_BYTES = 256 << 10  # the kernel's send buffer per connection (Linux doubles it), not its autotuned 4 MiB


def raw_error(status: int, reason: str, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 error answer (OpenAI-style body) that closes the connection, for refusals made before a
    request exists to answer through the ASGI app."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *([f"retry-after: {retry_after}"] if retry_after else [])]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionLimits:
    """:class:`HttpLimits` on each connection of a uvicorn HTTP protocol (mixed in before it; a subclass per limits:
    see :func:`protocol_for`). The protocol supplies how a request head is counted (``data_received``)."""

    limits: HttpLimits = HttpLimits()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # answers are written as they are generated: a deep kernel buffer buys nothing
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._waiting: tuple | None = None  # (the cycle when the wait began, its timer)
        self._stalled = None  # the timer of a write the client does not read
        self._head_bytes, self._tail = 0, b""  # bytes of a request head received so far; the last 3 of them
        self.idle_since = self.loop.time()
        self._wait_for_request(self.limits.header_timeout_s, "header")
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    # -- timers ---------------------------------------------------------------------------------------
    def _wait_for_request(self, seconds: float, what: str) -> None:
        """Close the connection unless a request begins within ``seconds``."""
        self._cancel_wait()
        self._waiting = (self.cycle, self.loop.call_later(seconds, self._no_request, what, seconds))

    def _cancel_wait(self) -> None:
        if self._waiting is not None:
            self._waiting[1].cancel()
            self._waiting = None

    def is_idle(self) -> bool:
        """No request in progress: none yet, or the last one answered."""
        return self.cycle is None or self.cycle.response_complete

    def _no_request(self, what: str, seconds: float) -> None:
        cycle, _ = self._waiting or (None, None)
        self._waiting = None
        if self.transport.is_closing() or self.cycle is not cycle or not self.is_idle():
            return  # a request began meanwhile
        if self._head_bytes:  # part of a request came, too slowly
            flag = "--header-timeout" if what == "header" else "--idle-timeout"
            self._close_with(raw_error(408, "Request Timeout", f"the request headers did not arrive within "
                                       f"{seconds:g} s ({flag})"))
            return
        self._close_with(b"")  # idle (or still sending a body refused already): closed without a word

    def _close_with(self, answer: bytes) -> None:
        if answer:
            self.transport.write(answer)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.idle_since = self.loop.time()
            if self.is_idle():  # (a pipelined request may have begun in super())
                self._wait_for_request(self.limits.idle_timeout_s, "idle")

    def connection_lost(self, exc) -> None:
        self._cancel_wait()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        super().connection_lost(exc)

    def _head_too_large(self) -> None:
        self._close_with(raw_error(431, "Request Header Fields Too Large", "the request line and headers are over "
                                   f"this server's limit of {self.limits.max_header_bytes} bytes (--max-header-bytes)"))

    # -- writing --------------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.limits.send_timeout_s, self._reader_gone)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _reader_gone(self) -> None:
        self._stalled = None
        log.info("disconnecting a client that read nothing of its answer for %g s (--send-timeout)",
                 self.limits.send_timeout_s)
        self.transport.abort()  # the answer's stream sees the disconnect and is cancelled

    # -- room -----------------------------------------------------------------------------------------
    def _make_room(self) -> None:
        """Past ``max_connections``: close the longest-idle connections; refuse this one (503) if none is idle."""
        excess = len(self.connections) - self.limits.max_connections
        idle = sorted((c for c in self.connections if c is not self and isinstance(c, ConnectionLimits)
                       and c.is_idle() and not c.transport.is_closing()), key=lambda c: c.idle_since)
        for other in idle[:excess]:
            other._close_with(b"")
            self.connections.discard(other)  # counted out now; its connection_lost follows
        if len(self.connections) > self.limits.max_connections:
            log.warning("refusing a connection: all %d connections have a request in progress (--max-connections)",
                        self.limits.max_connections)
            self._close_with(raw_error(503, "Service Unavailable", f"all {self.limits.max_connections} connections "
                                       "this server holds have a request in progress (--max-connections)", 1))
            self.connections.discard(self)


class LimitedH11Protocol(ConnectionLimits, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the limits: h11 itself bounds what it buffers of a head."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # h11 bounds what it buffers of a request head a little above ours: a backstop for data_received's check
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes + 4096)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a request head is arriving
            before = self._head_bytes
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                end = (self._tail + data).find(b"\r\n\r\n")  # where the head ends, if it does in this data
                if end < 0 or before - len(self._tail) + end + 4 > self.limits.max_header_bytes:
                    return self._head_too_large()
            self._tail = data[-3:]
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_bytes, self._tail = 0, b""


class HeadTooLarge(Exception):
    """Raised in llhttp's callback to stop it at a request head over the limit (no request begins)."""


if HttpToolsProtocol is not None:
    class LimitedHttpToolsProtocol(ConnectionLimits, HttpToolsProtocol):
        """uvicorn's httptools protocol (llhttp, in C: cheaper per request than h11, docs/benchmarks.md) with the
        limits. It buffers a request head without a bound of its own, so the bytes received while a head is open are
        counted here, and a head that arrived whole is measured once parsed."""

        _in_body = False  # between a request's head and its end
        _head_done = False  # a head was parsed during the current data_received
        _head_refused = False

        def data_received(self, data: bytes) -> None:
            if not self._in_body:
                self._head_bytes += len(data)
            self._head_done = False
            super().data_received(data)
            if self._head_done:
                self._head_bytes = 0
            elif not self._in_body and self._head_bytes > self.limits.max_header_bytes \
                    and not self.transport.is_closing():
                self._head_too_large()

        def on_headers_complete(self) -> None:
            if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > self.limits.max_header_bytes:
                self._head_refused = True
                raise HeadTooLarge  # uvicorn answers a parser error through send_400_response: 431 there
            self._head_done, self._in_body = True, True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if self._head_refused:
                return self._head_too_large()
            super().send_400_response(msg)


def http_protocol() -> str:
    """The HTTP implementation served: "httptools" where it is installed (faster), else "h11";
    ``TUNEPORT_HTTP_PROTOCOL`` picks one (both hold the same limits)."""
    asked = os.environ.get("TUNEPORT_HTTP_PROTOCOL", "auto")
    if asked not in ("auto", "h11", "httptools"):
        raise UserError(f"TUNEPORT_HTTP_PROTOCOL={asked} is not one of auto, h11, httptools", "unset it")
    if asked == "httptools" and HttpToolsProtocol is None:
        raise UserError("TUNEPORT_HTTP_PROTOCOL=httptools, but httptools is not installed", "pip install httptools")
    return asked if asked != "auto" else "h11" if HttpToolsProtocol is None else "httptools"


def protocol_for(limits: HttpLimits) -> type[ConnectionLimits]:
    """The protocol class uvicorn instantiates per connection, with ``limits``."""
    base = LimitedHttpToolsProtocol if http_protocol() == "httptools" else LimitedH11Protocol
    return type("GatewayProtocol", (base,), {"limits": limits})


def uvicorn_settings(limits: HttpLimits) -> dict:
    """``uvicorn.Config`` keywords for ``limits``."""
    return {"http": protocol_for(limits), "timeout_keep_alive": limits.idle_timeout_s, "limit_concurrency": None}


def ensure_file_descriptors(limits: HttpLimits) -> None:
    """Raise this process's open-file limit to its hard limit where ``max_connections`` needs it; refuse (exit 2)
    a ``max_connections`` the hard limit cannot hold."""
    need = limits.max_connections + SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise UserError(f"--max-connections {limits.max_connections} needs {need} open files, but this process may "
                        f"open at most {hard} (ulimit -Hn)",
                        f"lower --max-connections to {max(1, hard - SPARE_FDS)} or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else hard, hard))
