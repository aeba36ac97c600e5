"""OpenAI-compatible gateway (FastAPI): completions, chat, models, adapter admin, health, metrics.

With an API key every route needs ``Authorization: Bearer <key>``; adapter paths must lie inside
``--adapter-dir`` or the start-up paths; adapter names match ``[A-Za-z0-9._-]{1,64}``; bodies are
size-limited.
"""

from __future__ import annotations

import codecs
import contextlib
import hmac
import time
import uuid
from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from convert.errors import UserError

from .http import error_response
from .pool import PoolError
from .proxy import Upstream, forward
from .service import LlamaCppService, dumps, gen_request

MAX_BODY_BYTES = 1 << 20


def _stream_tokens(service: LlamaCppService, adapters: dict[str, float], prompt: list[int], body: dict,
                   token_ids: list[int] | None = None) -> Iterator[tuple[str, str | None, int]]:
    """(text delta, finish reason or None, tokens so far); holds the adapters for the whole generation.
    Generated token ids are appended to ``token_ids`` when given."""
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    with contextlib.ExitStack() as stack:
        for name in adapters:
            stack.enter_context(service.pool.use(name))
        req = gen_request(prompt, adapters, body)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text, sent, n, stopped = "", 0, 0, False
        hold = max((len(s) - 1 for s in stops if s), default=0)  # a stop string may still be forming
        for n, tok in enumerate(service.engine.generate(req), start=1):
            if token_ids is not None:
                token_ids.append(tok)
            seen = max(0, len(text) - hold)  # no stop string ends before here: earlier text was searched
            text += decoder.decode(service.engine.piece(tok))
            hit = next((at for s in stops if s and (at := text.find(s, seen)) >= 0), -1)
            if hit >= 0:
                text, stopped = text[:hit], True
                break
            if len(text) - hold > sent:
                yield text[sent : len(text) - hold], None, n
                sent = len(text) - hold
        finish = "length" if not stopped and n >= req.max_tokens else "stop"
        yield text[sent:], finish, n


class Guard:
    """Pure ASGI middleware (no per-request task as with ``@app.middleware``): API key, body size, count."""

    def __init__(self, app, api_key: str | None, max_body: int, metrics) -> None:
        self.app, self.max_body, self.metrics = app, max_body, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await error_response(401, "missing or wrong API key", "authentication_error")(scope, receive, send)
        if int(headers.get(b"content-length") or 0) > self.max_body:
            return await error_response(413, f"request body over {self.max_body} bytes")(scope, receive, send)
        self.metrics.inc("http_requests_total")
        return await self.app(scope, receive, send)


def create_app(service, api_key: str | None = None, max_body: int = MAX_BODY_BYTES) -> FastAPI:
    """The gateway over ``service``: a :class:`LlamaCppService` (tokens generated here) or a proxied
    service such as :class:`serve.vllm_service.VllmService` (OpenAI requests forwarded to the engine)."""
    upstream = Upstream(service.url) if getattr(service, "proxied", False) else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if upstream is not None:
            await upstream.aclose()

    app = FastAPI(title="tuneport gateway", lifespan=lifespan)
    metrics = service.metrics

    app.add_middleware(Guard, api_key=api_key, max_body=max_body, metrics=metrics)

    @app.exception_handler(PoolError)
    async def pool_error(_: Request, e: PoolError):
        return error_response(e.status, e.line())

    @app.exception_handler(UserError)
    async def user_error(_: Request, e: UserError):
        return error_response(400, e.line())

    @app.get("/health")
    async def health():
        if not getattr(service, "healthy", lambda: True)():
            return error_response(503, "the engine is not running; see the server log", "engine_down")
        return {"status": "ok", "model": service.name, "adapters": len(service.pool.names())}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(service.pool))

    @app.get("/v1/models")
    async def models():
        data = [{"id": service.name, "object": "model", "created": service.created, "owned_by": "tuneport"}]
        data += [{"id": n, "object": "model", "created": service.created, "owned_by": "tuneport",
                  "parent": service.name} for n in service.pool.names()]
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters():
        return {"adapters": service.pool.states(), "max_adapters": service.pool.max_adapters}

    @app.post("/v1/adapters", status_code=201)
    async def load(body: dict):
        if not isinstance(body.get("name"), str) or not isinstance(body.get("path"), str):
            raise PoolError("body needs 'name' and 'path' strings", "", status=400)
        entry = await run_in_threadpool(service.pool.add, body["name"], body["path"])
        return entry.state()

    @app.delete("/v1/adapters/{name}")
    async def unload(name: str):
        await run_in_threadpool(service.pool.remove, name)
        return {"name": name, "unloaded": True}

    async def generate(body: dict, prompt: list[int], chat: bool):
        model = body.get("model") or service.name
        adapters = service.adapters_for(model, body.get("adapters"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created, start = int(time.time()), time.perf_counter()
        obj = "chat.completion" if chat else "text_completion"
        metrics.inc("requests_total")
        if body.get("stream"):
            def events() -> Iterator[str]:
                first = True
                n = 0
                for delta, finish, n in _stream_tokens(service, adapters, prompt, body):  # noqa: B007
                    if chat:
                        d = {"role": "assistant", "content": delta} if first else {"content": delta}
                        choice = {"index": 0, "delta": d, "finish_reason": finish}
                    else:
                        choice = {"index": 0, "text": delta, "finish_reason": finish}
                    first = False
                    yield "data: " + dumps({"id": rid, "object": obj + (".chunk" if chat else ""),
                                            "created": created, "model": model, "choices": [choice]}) + "\n\n"
                metrics.inc("completion_tokens_total", n)
                metrics.observe(time.perf_counter() - start)
                yield "data: [DONE]\n\n"

            for name in adapters:  # answer 404 before the stream starts
                if name not in service.pool and not service.pool.adapter_dir:
                    raise PoolError(f"adapter {name!r} is not loaded", "load it first", status=404)
            return StreamingResponse(iterate_in_threadpool(events()), media_type="text/event-stream")

        ids: list[int] = []

        def collect():
            text, finish, count = "", None, 0
            for delta, fin, count in _stream_tokens(service, adapters, prompt, body, ids):  # noqa: B007
                text += delta
                finish = fin or finish
            return text, finish, count

        text, finish, n = await run_in_threadpool(collect)
        metrics.inc("completion_tokens_total", n)
        metrics.inc("prompt_tokens_total", len(prompt))
        metrics.observe(time.perf_counter() - start)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        if body.get("return_token_ids"):  # extension: the generated token ids
            choice["token_ids"] = ids
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}}

    @app.post("/v1/completions")
    async def completions(body: dict):
        if upstream is not None:
            return await forward(service, upstream, "/v1/completions", body)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = list(prompt)
        elif isinstance(prompt, str):
            tokens = service.tokenize(prompt)
        else:
            raise PoolError("prompt must be a string or a list of token ids", "", status=400)
        return await generate(body, tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: dict):
        if upstream is not None:
            return await forward(service, upstream, "/v1/chat/completions", body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PoolError("messages must be a non-empty list", "", status=400)
        return await generate(body, service.render_chat(messages), chat=True)

    return app
