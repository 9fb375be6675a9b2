"""How the HTTP front end answers what it cannot serve: a request body over the limit is 413 (an
ASGI middleware, before the body is parsed), and each error the app raises gets its status and an
OpenAI-style error body: a bad field 400, a missing or wrong API key 401, a tenant not allowed 403,
overload 429 (retry after 1 s), a draining or failed engine 503, a client gone 499."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata.cluster.engine_service import Draining, EngineFailed, Overloaded
from kvstrata.cluster.http_runs import ClientGone
from kvstrata.cluster.openai_protocol import bad_request, error_response, validation_error
from kvstrata.cluster.tenants import PermissionDenied, Unauthenticated


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is 413, by its Content-Length or, for a
    chunked body, as soon as the bytes read pass the limit."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            response = error_response(413, f"request body: over {self.limit} bytes", "invalid_request_error")
            return await response(scope, receive, send)
        seen = 0
        refused = False

        async def limited_receive() -> dict:
            nonlocal seen, refused
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit and not refused:
                refused = True  # answer 413 now; the app sees the client leave and its own answer is dropped
                response = error_response(413, f"request body: over {self.limit} bytes", "invalid_request_error")
                await response(scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)


def answer_errors(app: FastAPI) -> None:
    """Register the app's exception handlers."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return bad_request(str(exc))

    @app.exception_handler(Unauthenticated)
    async def on_unauthenticated(request: Request, exc: Unauthenticated) -> JSONResponse:
        return error_response(401, str(exc), "authentication_error", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(PermissionDenied)
    async def on_denied(request: Request, exc: PermissionDenied) -> JSONResponse:
        return error_response(403, str(exc), "permission_error")

    @app.exception_handler(Overloaded)
    async def on_overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        return error_response(429, str(exc), "overloaded_error", headers={"Retry-After": "1"})

    @app.exception_handler(Draining)
    async def on_draining(request: Request, exc: Draining) -> JSONResponse:
        return error_response(503, str(exc), "unavailable_error", headers={"Retry-After": "5"})

    @app.exception_handler(EngineFailed)
    async def on_engine_failed(request: Request, exc: EngineFailed) -> JSONResponse:
        return error_response(503, str(exc), "unavailable_error", headers={"Retry-After": "5"})

    @app.exception_handler(ClientGone)
    async def on_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)
