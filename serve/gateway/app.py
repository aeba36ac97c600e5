"""The gateway app: middleware, error handling and the three routers over one backend."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from tuneport.convert.errors import UserError

from ..backend import Backend
from ..errors import ApiError
from ..http import error_response
from ..limits import HttpLimits
from .admin_routes import admin_router
from .body_limit import BodyLimit
from .middleware import AccessLog, InFlightLimit, KeyGuard
from .openai_routes import openai_router
from .ops_routes import ops_router

PARSE_ERROR = "the request body is not valid JSON (not UTF-8, or nested too deeply)"


def create_app(backend: Backend, api_key: str | None = None, limits: HttpLimits | None = None, *,
               admin_key: str | None = None, max_tokens_limit: int | None = None,
               max_concurrent_per_key: int | None = None) -> FastAPI:
    """The gateway over ``backend``; it uses nothing of the engine but the :class:`Backend` contract.
    ``limits``: the body's size and time (:class:`.body_limit.BodyLimit`; the connection limits are the server's);
    ``admin_key`` gives the admin API a key of its own; ``max_tokens_limit`` caps a request's ``max_tokens``
    (400 above); ``max_concurrent_per_key`` caps the generation requests each key has in flight (429 above)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await backend.aclose()

    app = FastAPI(title="tuneport gateway", lifespan=lifespan)
    # the cheapest refusals first (the last added runs first): the key; requests in flight (a request counts from
    # its first byte, so a body sent slowly holds its key's slot); the body's size and time
    app.add_middleware(BodyLimit, limits=limits or HttpLimits(), metrics=backend.metrics)
    app.add_middleware(InFlightLimit, max_concurrent_per_key=max_concurrent_per_key)
    app.add_middleware(KeyGuard, api_key=api_key, admin_key=admin_key)
    app.add_middleware(AccessLog, metrics=backend.metrics)  # outermost: every refusal is logged too

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return error_response(e.status, e.line(), e.kind)

    @app.exception_handler(UserError)
    async def user_error(_: Request, e: UserError):
        return error_response(400, e.line())

    @app.exception_handler(RequestValidationError)  # FastAPI's 422 for a body that is not a JSON object
    async def bad_body(_: Request, e: RequestValidationError):
        return error_response(400, body_problem(e.errors()))

    @app.exception_handler(HTTPException)  # unknown routes, wrong methods, unparsable bodies: OpenAI-style too
    async def http_error(_: Request, e: HTTPException):
        detail = PARSE_ERROR if e.detail == "There was an error parsing the body" else str(e.detail)  # FastAPI's
        response = error_response(e.status_code, detail,
                                  "invalid_request_error" if e.status_code < 500 else "upstream_error")
        response.headers.update(e.headers or {})
        return response

    for router in (openai_router(backend, max_tokens_limit), admin_router(backend), ops_router(backend)):
        app.include_router(router)
    return app


def body_problem(errors: list[dict]) -> str:
    """FastAPI's complaint about a request body, as the one line a client reads."""
    for err in errors:
        if err.get("type") == "json_invalid":
            at = f" at character {err['loc'][1]}" if len(err.get("loc", ())) > 1 else ""
            return f"the request body is not valid JSON ({(err.get('ctx') or {}).get('error', 'decode error')}{at})"
    if all(tuple(err.get("loc", ()))[:1] == ("body",) for err in errors):
        return "the request body must be a JSON object"
    return "; ".join(str(err.get("msg")) for err in errors[:3])
