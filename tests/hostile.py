"""A hostile-client suite: requests framed to hurt a server, each with the answer it must get, the server's memory
watched throughout, and after each one a normal request that must still get the normal answer.

Clients speak raw HTTP/1.1 over sockets (a lying Content-Length, chunked bodies, slow bytes, half requests are
what an HTTP library will not send). :func:`run_suite` runs every case against a server already listening and
returns one :class:`Outcome` per case; :func:`table` prints them (docs/reliability.md shows one run).
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

MIB = 1 << 20


@dataclass
class Target:
    """A running server: where it listens, the processes that hold what clients send, and its limits."""

    host: str
    port: int
    pids: list[int]  # the processes whose memory is watched (the gateway; on Ray its proxy and ingress)
    model: str  # the base's served name
    max_body: int = MIB
    body_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    send_timeout_s: float = 60.0
    max_connections: int = 1024
    local_server: bool = True  # tuneport's own HTTP server (on Ray, Ray's proxy holds the connections)
    normal_answer: str = ""
    flood_cap: int | None = None  # the most bytes a flood case offers (a baseline that reads bodies whole)
    choices: int = 8  # the most choices (n) a request may ask for (MLX: 1; its context must then hold 1,600 tokens)

    def rss_mb(self) -> float:
        total = 0
        for pid in self.pids:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return total / MIB

    def connect(self, timeout: float = 30.0) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=timeout)


@dataclass
class Outcome:
    case: str
    expected: str
    got: str
    ms: float
    rss_before: float
    rss_peak: float
    rss_after: float
    ok: bool
    next_ok: bool = True  # the normal request after it got the normal answer
    note: str = ""

    @property
    def growth(self) -> float:
        return self.rss_peak - self.rss_before


class Closed(Exception):
    """The server closed the connection (or reset it) before a whole answer came."""


def completion(model: str, prompt: str = "The model", **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def head(method: str, path: str, *, length: int | None = None, chunked: bool = False, extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class Reader:
    """Reads HTTP/1.1 answers off one socket (Content-Length, chunked, or until close)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _more(self) -> None:
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError) as e:
            raise Closed("reset") from e
        except TimeoutError as e:
            raise Closed("no answer (timed out)") from e
        if not data:
            raise Closed("closed")
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._more()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def status(self) -> tuple[int, dict[str, str]]:
        """The status and headers of the next answer."""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        text, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = text.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
        return int(lines[0].split()[1]), headers

    def body(self, headers: dict[str, str]) -> bytes:
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                self._more()
            out, self.buf = self.buf[:n], self.buf[n:]
            return out
        if headers.get("transfer-encoding") == "chunked":
            out = b""
            while True:
                size = int(self._line().split(b";")[0], 16)
                while len(self.buf) < size + 2:
                    self._more()
                out, self.buf = out + self.buf[:size], self.buf[size + 2:]
                if size == 0:
                    return out
        while True:
            try:
                self._more()
            except Closed:
                out, self.buf = self.buf, b""
                return out

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        status, headers = self.status()
        return status, headers, self.body(headers)


def request(target: Target, payload: bytes | dict, path: str = "/v1/completions",
            timeout: float = 120.0) -> tuple[int, bytes]:
    """One well-formed request on a fresh connection: (status, body)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with target.connect(timeout) as sock:
        sock.sendall(head("POST", path, length=len(body)) + body)
        status, _, data = Reader(sock).answer()
    return status, data


class ServeProcess:
    """``tuneport serve ARGS`` in its own process (its own session: stopped with its children), up once ``/health``
    answers 200; the log goes to ``log``."""

    def __init__(self, args: list[str], port: int, log: Path, start_s: float, env: dict | None = None) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tuneport.toolkit.cli", "serve", "--port", str(port),
                                          *args], stdout=out, stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                         start_new_session=True)
        deadline = time.monotonic() + start_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tuneport serve exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tuneport serve did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def children(self, needle: str) -> list[int]:
        """The pids of this server's descendants whose command line holds ``needle``."""
        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)
                if needle in " ".join(c.cmdline())]

    def stop(self) -> None:
        """SIGINT (serve finishes in-flight requests and stops its engine), then SIGKILL after 2 minutes."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def normal_answer(target: Target) -> str:
    status, data = request(target, completion(target.model))
    if status != 200:
        return f"HTTP {status}: {data[:200]!r}"
    return json.loads(data)["choices"][0]["text"]


class MemoryWatch:
    """Samples the target's RSS every 10 ms while a case runs."""

    def __init__(self, target: Target) -> None:
        self.target, self.peak, self._stop = target, target.rss_mb(), threading.Event()
        self.before = self.peak
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.target.rss_mb())

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.target.rss_mb())


# -- the cases: each returns (what it got, ms, note); `expected` says what it must get ------------------------
@dataclass
class Case:
    name: str
    expected: str
    run: Callable[[Target], tuple[str, float, str]]
    accept: Callable[[str, Target], bool]
    connection_level: bool = False  # held by tuneport's own server; through Ray's proxy, Ray's rules apply
    max_growth_mb: float = 16.0
    extra: dict = field(default_factory=dict)


def _status(s: str) -> Callable[[str, Target], bool]:
    return lambda got, _: got.split()[0] == s


def _padded(target: Target, size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON whitespace after the object)."""
    body = json.dumps(completion(target.model)).encode()
    return body + b" " * (size - len(body))


def _timed(fn: Callable[[], str]) -> tuple[str, float]:
    start = time.perf_counter()
    got = fn()
    return got, (time.perf_counter() - start) * 1000


def content_length_under(target: Target) -> tuple[str, float, str]:
    body = _padded(target, target.max_body - 1)
    got, ms = _timed(lambda: str(request(target, body)[0]))
    return got, ms, f"{len(body)} bytes"


def content_length_over(target: Target) -> tuple[str, float, str]:
    body = _padded(target, target.max_body + 1)
    with target.connect() as sock:
        start = time.perf_counter()
        sock.sendall(head("POST", "/v1/completions", length=len(body)))  # the head alone: refused on it
        status, _ = Reader(sock).status()
    return str(status), (time.perf_counter() - start) * 1000, "answered on the head, before the body was sent"


def chunked_under(target: Target) -> tuple[str, float, str]:
    body = _padded(target, target.max_body - 1)
    with target.connect() as sock:
        start = time.perf_counter()
        sock.sendall(head("POST", "/v1/completions", chunked=True))
        for i in range(0, len(body), 65536):
            sock.sendall(chunk(body[i:i + 65536]))
        sock.sendall(b"0\r\n\r\n")
        status, _, _ = Reader(sock).answer()
    return str(status), (time.perf_counter() - start) * 1000, f"{len(body)} bytes in 64 KiB chunks"


def chunked_flood(target: Target, total: int = 400 * MIB, model: str | None = None,
                  from_start: bool = False) -> tuple[str, float, str]:
    """``total`` bytes offered as a chunked body (a JSON prompt that never ends), sent until the answer comes;
    ms: from the moment the bytes sent passed the limit (``from_start``: from the first byte) to the answer.
    The sender looks for the answer before each piece, so "sent" is what the server took in before it answered,
    not what a busy machine let through before the reading thread ran (the server drains a refused body)."""
    piece = b"a" * 65536
    total = min(total, target.flood_cap or total)
    sent, passed, answer = 0, [None], {}
    done = threading.Event()
    sock = target.connect()

    def send() -> None:
        nonlocal sent
        try:
            prefix = json.dumps({"model": model or target.model, "max_tokens": 1})[:-1] + ', "prompt": "'
            sock.sendall(head("POST", "/v1/completions", chunked=True) + chunk(prefix.encode()))
            while sent < total and not done.is_set():
                if select.select([sock], [], [], 0)[0]:  # the answer (or the close) is there: stop offering
                    break
                sock.sendall(chunk(piece))
                sent += len(piece)
                if passed[0] is None and sent > target.max_body:
                    passed[0] = time.perf_counter()
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    started = time.perf_counter()
    sender.start()
    try:
        answer["status"], _ = Reader(sock).status()
    except Closed as e:
        answer["status"] = str(e)
    finally:
        got_at = time.perf_counter()
        done.set()
        sender.join(30)
        sock.close()
    ms = max(0.0, got_at - (started if from_start else passed[0] or got_at)) * 1000
    return str(answer["status"]), ms, f"{sent / MIB:.1f} MiB sent of {total // MIB} MiB offered"


def lying_length_short(target: Target) -> tuple[str, float, str]:
    body = json.dumps(completion(target.model)).encode()
    with target.connect() as sock:
        start = time.perf_counter()
        sock.sendall(head("POST", "/v1/completions", length=len(body)) + body + b"GARBAGE THAT IS NO REQUEST\r\n\r\n")
        reader = Reader(sock)
        first, _, _ = reader.answer()
        try:
            second = str(reader.answer()[0])
        except Closed as e:
            second = str(e)
    return f"{first}, then {second}", (time.perf_counter() - start) * 1000, "a request, then 30 bytes past its " \
        "Content-Length"


def lying_length_long(target: Target) -> tuple[str, float, str]:
    body = json.dumps(completion(target.model)).encode()
    with target.connect(timeout=target.body_timeout_s + 30) as sock:
        start = time.perf_counter()
        sock.sendall(head("POST", "/v1/completions", length=len(body) + 100) + body)
        try:
            got = str(Reader(sock).status()[0])
        except Closed as e:
            got = str(e)
    return got, (time.perf_counter() - start) * 1000, "100 bytes promised that never come"


def trickle(sock: socket.socket, data: bytes, give_up_s: float) -> int:
    """Send ``data`` one byte every 0.2 s until the server answers or closes, all is sent, or ``give_up_s`` passes;
    the bytes sent."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    sent, give_up = 0, time.monotonic() + give_up_s
    try:
        while sent < len(data) and time.monotonic() < give_up:
            try:
                sent += sock.send(data[sent:sent + 1])
            except BlockingIOError:
                pass
            time.sleep(0.2)
            try:
                sock.recv(1, socket.MSG_PEEK)  # an answer (or the server closing): stop
                break
            except BlockingIOError:
                continue
    except OSError:
        pass
    sock.settimeout(timeout)  # (setblocking(True) would wait for ever)
    return sent


def slow_body(target: Target) -> tuple[str, float, str]:
    body = _padded(target, 2000)
    with target.connect(timeout=target.body_timeout_s + 30) as sock:
        start = time.perf_counter()
        sock.sendall(head("POST", "/v1/completions", length=len(body)))
        sent = trickle(sock, body, target.body_timeout_s + 10)
        try:
            got = str(Reader(sock).status()[0])
        except Closed as e:
            got = str(e)
    return got, (time.perf_counter() - start) * 1000, f"{sent} of {len(body)} bytes, 5 a second"


def slow_headers(target: Target) -> tuple[str, float, str]:
    text = head("POST", "/v1/completions", length=10)
    with target.connect(timeout=target.header_timeout_s + 30) as sock:
        start = time.perf_counter()
        sent = trickle(sock, text, target.header_timeout_s + 10)
        try:
            got = str(Reader(sock).status()[0])
        except Closed as e:
            got = str(e)
    return got, (time.perf_counter() - start) * 1000, f"{sent} header bytes, 5 a second"


def huge_head(target: Target) -> tuple[str, float, str]:
    with target.connect() as sock:
        start = time.perf_counter()
        try:
            sock.sendall(head("POST", "/v1/completions", length=2, extra=f"X-Filler: {'a' * 64 * 1024}\r\n") + b"{}")
            got = str(Reader(sock).status()[0])
        except (Closed, OSError) as e:
            got = str(e) if isinstance(e, Closed) else "reset"
    return got, (time.perf_counter() - start) * 1000, "one 64 KiB header"


def gone_mid_body(target: Target) -> tuple[str, float, str]:
    start = time.perf_counter()
    for _ in range(20):
        with target.connect() as sock:
            sock.sendall(head("POST", "/v1/completions", length=100_000) + b'{"prompt": "' + b"a" * 50_000)
    return "-", (time.perf_counter() - start) * 1000, "20 clients, each gone after half its body"


def gone_mid_stream(target: Target) -> tuple[str, float, str]:
    body = json.dumps(completion(target.model, max_tokens=64, stream=True, ignore_eos=True)).encode()
    start = time.perf_counter()
    for _ in range(20):
        with target.connect() as sock:
            sock.sendall(head("POST", "/v1/completions", length=len(body)) + body)
            reader = Reader(sock)
            reader.status()
            reader._line()  # the first event's chunk size: the stream is running
    return "-", (time.perf_counter() - start) * 1000, "20 streams, each dropped after its first event"


def server_side_state(target: Target, client: socket.socket) -> str | None:
    """The TCP state of the server's end of ``client``'s connection, from /proc/net/tcp* (Linux): "01" while it is
    established, "04" once the server closed it with data still queued (FIN_WAIT1), None once it is gone."""
    client_port = client.getsockname()[1]
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, remote, state = line.split()[1:4]
            if int(local.rsplit(":", 1)[1], 16) == target.port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                return state
    return None


def long_stream(target: Target) -> bytes:
    """The request of :func:`stalled_reader`: 1,600 tokens in ``target.choices`` choices, 20 alternatives each."""
    return json.dumps(completion(target.model, max_tokens=1600 // target.choices, stream=True, ignore_eos=True,
                                 logprobs=20, n=target.choices, temperature=1.0, seed=0)).encode()  # vLLM: n>1 sampled


def warm_up(target: Target) -> None:
    """The long stream read whole once, so that the engine's own memory for 1,600 tokens is not counted in a case."""
    status, _ = request(target, long_stream(target))
    assert status == 200, f"the long stream was refused ({status})"


def stalled_reader(target: Target) -> tuple[str, float, str]:
    """A stream of large events (1,600 tokens in 8 choices, 20 alternatives each: ~1 MB) that the client does not
    read, its receive buffer 4 KiB, until the server lets go of the connection (or a minute passes): the server
    must drop it at --send-timeout instead of holding its answer (and its sequences) for ever."""
    body = long_stream(target)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(target.send_timeout_s + 60)
    sock.connect((target.host, target.port))
    start = time.perf_counter()
    sock.sendall(head("POST", "/v1/completions", length=len(body)) + body)
    give_up = time.monotonic() + target.send_timeout_s + 60
    while server_side_state(target, sock) == "01" and time.monotonic() < give_up:
        time.sleep(0.2)
    let_go = (time.perf_counter() - start) * 1000
    received, tail, first = 0, b"", b""
    try:  # now read what came: the whole answer, or the part the server had sent when it let go
        while True:
            data = sock.recv(65536)
            if not data:
                break
            first = first or data[:16]
            if not first.startswith(b"HTTP/1.1 200"):  # refused: not the case this is about
                return first[9:12].decode(), let_go, "the request was refused"
            received, tail = received + len(data), (tail + data)[-32:]
            if tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk: the whole answer came
                return "whole answer", let_go, f"all {received} bytes came"
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        sock.close()
    return "disconnected", let_go, f"{received} bytes came before the server let go"


def idle_connections(target: Target, count: int = 1100) -> tuple[str, float, str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1024), hard))
    socks = []
    try:
        for _ in range(count):
            socks.append(target.connect(timeout=30))
        time.sleep(0.5)
        got, ms = _timed(lambda: str(request(target, completion(target.model), timeout=30)[0]))
        open_now = sum(1 for s in socks if _still_open(s))
    finally:
        for s in socks:
            s.close()
    return got, ms, f"{count} idle connections, {open_now} still open after the request"


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def deep_json(target: Target) -> tuple[str, float, str]:
    body = b"[" * 100_000 + b"]" * 100_000
    got, ms = _timed(lambda: str(request(target, body)[0]))
    return got, ms, "100,000 nested arrays"


def many_token_ids(target: Target) -> tuple[str, float, str]:
    body = json.dumps(completion(target.model, prompt=[5] * 150_000)).encode()
    got, ms = _timed(lambda: str(request(target, body)[0]))
    return got, ms, f"{len(body) // 1024} KiB of JSON"


def invalid_utf8(target: Target) -> tuple[str, float, str]:
    body = b'{"model": "' + target.model.encode() + b'", "prompt": "\xff\xfe\xc3\x28", "max_tokens": 2}'
    got, ms = _timed(lambda: str(request(target, body)[0]))
    return got, ms, "bytes FF FE C3 28"


def huge_prompt(target: Target) -> tuple[str, float, str]:
    n = 10 ** 8
    prefix = json.dumps({"model": target.model, "max_tokens": 1})[:-1].encode() + b', "prompt": "'
    length = len(prefix) + n + 2
    with target.connect() as sock:
        start = time.perf_counter()
        sock.sendall(head("POST", "/v1/completions", length=length) + prefix)
        status, _ = Reader(sock).status()
    return str(status), (time.perf_counter() - start) * 1000, "Content-Length 100,000,0xx"


def long_text_prompt(target: Target) -> tuple[str, float, str]:
    body = json.dumps(completion(target.model, prompt="word " * 180_000)).encode()
    got, ms = _timed(lambda: str(request(target, body)[0]))
    return got, ms, f"{len(body) // 1024} KiB of text, refused by its bytes before tokenizing"


def unknown_model_long_prompt(target: Target) -> tuple[str, float, str]:
    body = json.dumps(completion("no-such-adapter", prompt="word " * 180_000)).encode()
    got, ms = _timed(lambda: str(request(target, body)[0]))
    return got, ms, f"{len(body) // 1024} KiB prompt"


def unknown_model_flood(target: Target) -> tuple[str, float, str]:
    return chunked_flood(target, 100 * MIB, model="no-such-adapter", from_start=True)


CASES = [
    Case("Content-Length body, 1 byte under the limit", "200", content_length_under, _status("200")),
    Case("Content-Length body, 1 byte over the limit", "413 on the head", content_length_over, _status("413")),
    Case("chunked body, 1 byte under the limit", "200", chunked_under, _status("200")),
    Case("chunked body, 400 MiB offered", "413 < 1 s after the limit", chunked_flood,
         lambda got, _: got == "413"),
    Case("Content-Length shorter than the body", "400 for the bytes past it", lying_length_short,
         lambda got, _: got in ("200, then 400", "400, then closed")),  # h11 answers the declared request first
    Case("Content-Length longer than the body", "408 at --body-timeout", lying_length_long, _status("408")),
    Case("body at 5 bytes a second", "408 at --body-timeout", slow_body, _status("408")),
    Case("headers at 5 bytes a second", "408 at --header-timeout", slow_headers, _status("408"),
         connection_level=True),
    Case("a 64 KiB header", "431", huge_head, _status("431"), connection_level=True),
    Case("clients gone mid-body", "nothing to answer", gone_mid_body, lambda got, _: True),
    Case("clients gone mid-stream", "streams cancelled", gone_mid_stream, lambda got, _: True),
    Case("a client that stops reading its stream", "disconnected at --send-timeout", stalled_reader,
         _status("disconnected"), connection_level=True),
    Case("1,100 idle connections", "200 (the longest-idle closed)", idle_connections, _status("200"),
         connection_level=True),
    Case("JSON nested 100,000 deep", "400", deep_json, _status("400")),
    Case("a prompt of 150,000 token ids", "400 before the engine", many_token_ids, _status("400")),
    Case("invalid UTF-8", "400", invalid_utf8, _status("400")),
    Case("a prompt of 10^8 characters", "413 on the head", huge_prompt, _status("413")),
    Case("a prompt of 900 KiB of text", "400 before tokenizing", long_text_prompt, _status("400")),
    Case("unknown model, 900 KiB prompt", "404 before tokenizing", unknown_model_long_prompt, _status("404")),
    Case("unknown model, 100 MiB chunked prompt", "413 < 100 ms from the first byte", unknown_model_flood,
         _status("413")),
]


def run_case(target: Target, case: Case) -> Outcome:
    with MemoryWatch(target) as mem:
        start = time.perf_counter()
        try:
            got, ms, note = case.run(target)
        except (Closed, OSError) as e:  # a server that never answers (or resets) where an answer was due
            got, ms, note = str(e) if isinstance(e, Closed) else type(e).__name__, 0.0, ""
            ms = (time.perf_counter() - start) * 1000
    after = target.rss_mb()
    ok = case.accept(got, target) if target.local_server or not case.connection_level else True
    answer = normal_answer(target)
    return Outcome(case.name, case.expected, got, ms, mem.before, mem.peak, after, ok,
                   answer == target.normal_answer, note)


def run_suite(target: Target, cases: list[Case] = CASES) -> list[Outcome]:
    warm_up(target)
    target.normal_answer = target.normal_answer or normal_answer(target)
    return [run_case(target, case) for case in cases]


def table(title: str, outcomes: list[Outcome]) -> list[str]:
    lines = [title, "| case | must get | got | ms | server RSS before / peak / after (MiB) | next request | what was "
             "sent |", "|---|---|---|---:|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.case} | {o.expected} | {o.got} | {o.ms:.0f} | {o.rss_before:.1f} / {o.rss_peak:.1f} / "
                     f"{o.rss_after:.1f} | {'normal answer' if o.next_ok else 'WRONG'} | {o.note} |")
    return lines
