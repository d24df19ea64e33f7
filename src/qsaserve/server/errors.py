"""OpenAI-style error bodies and the app's exception handlers.

Every client mistake is a 400 naming the parameter (404 for unknown routes and models); a full
waiting queue is a 429 with Retry-After; a dead or draining engine is a 503; only server bugs are
500s (logged with their traceback)."""
from __future__ import annotations

import json
import logging
import reprlib
from typing import Iterable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from qsaserve.engine.async_engine import EngineOverloadedError
from qsaserve.errors import EngineDeadError, InvalidRequestError
from qsaserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("qsaserve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


class ServerShuttingDown(Exception):
    """The server is draining: it takes no new requests and ends those past the grace period."""


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def shutting_down_response() -> JSONResponse:
    return error_response(503, "the server is shutting down; send the request again (to another server)",
                          type="service_unavailable_error", code="server_shutting_down", headers={"Connection": "close"})


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def loc_to_param(loc: Iterable) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; drops pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "body" and not out:
            continue
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict", "none"):
            out += ("." if out else "") + part
    return out or "body"


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxlist, _PREVIEW.maxdict, _PREVIEW.maxstring, _PREVIEW.maxother = 2, 6, 6, 60, 60


def preview(value) -> str:
    """A short rendering of a refused value; its cost is bounded however large the value is."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)[:80]
    if isinstance(value, str):
        return json.dumps(value[:60]) + ("..." if len(value) > 60 else "")
    return _PREVIEW.repr(value)


def validation_error(errors: Sequence[dict]) -> ApiError:
    err = errors[0]
    param = loc_to_param(err.get("loc", ()))
    detail = err.get("msg", "invalid value")
    if err.get("type") != "missing":
        detail += f" (got {preview(err.get('input'))})"
    return bad_request(param, f"{param}: {detail}")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid(_: Request, e: InvalidRequestError):
        return error_response(400, str(e), param=e.param)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, e: EngineOverloadedError):
        # 429: the request is fine but the waiting queue is full now (the openai client retries it).
        return error_response(429, str(e), type="rate_limit_error", code="server_overloaded",
                              headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e), type="service_unavailable_error", code="engine_dead")

    @app.exception_handler(ServerShuttingDown)
    async def shutting_down(_: Request, e: ServerShuttingDown):
        return shutting_down_response()

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, e: RequestValidationError):
        err = validation_error(e.errors())
        return error_response(400, err.message, param=err.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "internal_server_error"
        message = str(e.detail)
        if e.status_code == 404:  # OpenAI's wording for a route it does not serve
            message = f"Invalid URL ({request.method} {request.url.path}): this server has no such route"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(e.status_code, message, type=kind, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect):
        # The client left while its request body was still being read: nothing was queued and no
        # one is listening. Recorded as 499 (client closed request), like a disconnect mid-generation.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        logger.exception("internal error while serving a request")
        return error_response(500, f"internal server error: {type(e).__name__}", type="internal_server_error")
