"""A backend whose engine is an OpenAI-compatible server in a child process (vLLM, TabbyAPI): requests are
forwarded to it with the adapters they name held in the pool, its answers relabelled with the model name the
client asked for, and its usage counted. Subclasses start the child and say what loading an adapter means."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import ClassVar

import httpx

from ..backend import Backend, Kind, Usage
from ..errors import ApiError
from ..http import error_message

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RENDERED_WHOLE = ("system", "developer", "user", "tool")  # roles whose text every chat template renders as it is


def prompt_text_bytes(kind: Kind, body: dict) -> list[int]:
    """Bytes of text each prompt of a request has at least: a completion's prompt strings; a chat's messages of the
    roles every template renders whole (an assistant's may lose its reasoning), text parts included."""
    def utf8(text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

    if kind == "completions":
        prompt = body.get("prompt")
        return [utf8(p) for p in (prompt if isinstance(prompt, list) else [prompt]) if isinstance(p, str)]
    total = 0
    for m in body.get("messages") or []:
        if not isinstance(m, dict) or m.get("role") not in RENDERED_WHOLE:
            continue
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        total += sum(utf8(p) for p in parts if isinstance(p, str))
        total += sum(utf8(p["text"]) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    return [total]


class UpstreamBackend(Backend):
    """The forwarding half of an engine behind the gateway; ``url`` is the child server's address."""

    label: ClassVar[str]  # how error messages name the engine
    url: str
    _client: httpx.AsyncClient | None = None
    _client_loop: asyncio.AbstractEventLoop | None = None
    _failure: str | None = None

    def _check_up(self) -> None:
        if self._failure is not None:
            raise ApiError(f"{self.label} stopped and is not serving; see the server log", status=503)

    def upstream_model(self, model: str) -> str:
        """The model name the child serves a request for ``model`` under."""
        return model

    @property
    def client(self) -> httpx.AsyncClient:
        """An async client to the child, made in the event loop that uses it (closed by :meth:`aclose` when
        the gateway stops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # below uvicorn's 5 s keep-alive timeout on the child's side: never reuse a connection it is closing
            limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=2.0)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10),
                                             limits=limits)
            self._client_loop = loop
        return self._client

    def _route(self, kind: Kind, body: dict) -> tuple[str, list[str], dict]:
        """The model name the client asked for, the adapters to hold, and the body the child gets."""
        self._check_up()
        adapters = self.adapters_for(body)  # refuses weighted mixes
        for nbytes in prompt_text_bytes(kind, body):  # before the child tokenizes what cannot fit
            self.check_prompt_bytes(nbytes)
        self.check_prompt_ids(kind, body)
        model = body.get("model") or self.name
        return model, list(adapters), {**body, "model": self.upstream_model(model)}

    def check_prompt_ids(self, kind: Kind, body: dict) -> None:
        """Refuse (400) a completion prompt of more token ids than the context holds, before it is forwarded."""
        prompt, limit = body.get("prompt"), self.prompt_token_limit
        if kind != "completions" or limit is None or not isinstance(prompt, list) or not prompt:
            return
        for ids in prompt if isinstance(prompt[0], list) else [prompt]:
            if isinstance(ids, list) and len(ids) > limit:
                raise ApiError(f"the prompt is {len(ids)} tokens, more than the context of {limit} holds",
                               "shorten the prompt")

    def whole_answer_body(self, body: dict) -> dict:
        """The body of a request answered whole (not streamed), as the child needs it to report usage."""
        return body

    async def generate(self, kind: Kind, body: dict, usage: Usage) -> dict:
        model, adapters, sent = self._route(kind, body)
        sent = self.whole_answer_body(sent)
        with await self.hold(adapters):
            r = await self._post(kind, sent)
        if r.status_code != 200:
            raise self._upstream_error(r)
        data = r.json()
        data["model"] = model  # the child names the model it ran
        u = data.get("usage") or {}
        usage.prompt_tokens, usage.completion_tokens = int(u.get("prompt_tokens") or 0), int(
            u.get("completion_tokens") or 0)
        return data

    async def stream(self, kind: Kind, body: dict, usage: Usage) -> AsyncIterator[bytes]:
        model, adapters, sent = self._route(kind, body)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        sent["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        relabel = sent["model"] != model
        with await self.hold(adapters):
            try:
                r = await self.client.send(self.client.build_request("POST", PATHS[kind], json=sent), stream=True)
            except httpx.HTTPError as e:
                raise self._unreachable(e) from e
            try:
                if r.status_code != 200:
                    await r.aread()
                    raise self._upstream_error(r)
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and (relabel or '"usage"' in line):
                        chunk = self._relabel(json.loads(line[6:]), model, usage, wants_usage)
                        if chunk is None:
                            continue
                        line = "data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
                    yield (line + "\n").encode()
            finally:
                await r.aclose()

    @staticmethod
    def _relabel(chunk: dict, model: str, usage: Usage, wants_usage: bool) -> dict | None:
        """A streamed chunk as the client gets it: the model it asked for, the usage counted wherever the child
        puts it (vLLM: a chunk of its own; TabbyAPI: beside the last choice), and dropped unless asked for."""
        if chunk.get("usage"):
            usage.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
            usage.completion_tokens = int(chunk["usage"].get("completion_tokens") or 0)
            if not wants_usage:
                if not chunk.get("choices"):
                    return None
                chunk.pop("usage")
        if "model" in chunk:
            chunk["model"] = model
        return chunk

    async def _post(self, kind: Kind, body: dict) -> httpx.Response:
        try:
            return await self.client.post(PATHS[kind], json=body)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e

    def _upstream_error(self, r: httpx.Response) -> ApiError:
        """The child's error with its message; its 5xx become 502 (the gateway itself is fine)."""
        return ApiError(f"{self.label}: {error_message(r)}", status=r.status_code if r.status_code < 500 else 502)

    def _unreachable(self, e: Exception) -> ApiError:
        return ApiError(f"{self.label} is not reachable ({type(e).__name__}); see the server log", status=502)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = self._client_loop = None
