"""Every error the server returns, rendered once, in the protocol of the route.

Anthropic routes (``/v1/messages...``) get ``{"type": "error", "error": {"type",
"message"}}``; every other route gets OpenAI's ``{"error": {"message", "type",
"param", "code"}}``. Extra fields an error carries (``available_models``,
``valid_profiles``) go inside the inner ``error`` object in both shapes.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gmlx.engine.errors import EngineError, GmlxError, InvalidRequestError

log = logging.getLogger("gmlx.server")

Protocol = Literal["openai", "anthropic"]


class RouteError(GmlxError):
    """A request for a route or method the server does not have."""

    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        if status != 404:
            self.anthropic_type = "invalid_request_error"


def protocol_for(path: str) -> Protocol:
    """Which protocol's error shape a route speaks."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(exc: GmlxError, protocol: Protocol) -> dict[str, Any]:
    """The JSON body of an error, in a protocol's shape."""
    if protocol == "anthropic":
        return {
            "type": "error",
            "error": {"type": exc.anthropic_type, "message": exc.message, **exc.extra},
        }
    return {
        "error": {
            "message": exc.message,
            "type": exc.openai_type,
            "param": exc.param,
            "code": exc.code,
            **exc.extra,
        }
    }


def error_response(exc: GmlxError, protocol: Protocol) -> JSONResponse:
    return JSONResponse(error_body(exc, protocol), status_code=exc.status, headers=exc.headers)


def validation_error(exc: RequestValidationError | ValidationError) -> InvalidRequestError:
    """A pydantic validation failure as one sentence naming the field."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc)
    where = f" at {field}" if field else ""
    more = len(exc.errors()) - 1
    extra = f" (and {more} more problems)" if more > 0 else ""
    return InvalidRequestError(
        f"Invalid request body{where}: {first.get('msg', 'invalid value')}{extra}.",
        param=field or None,
    )


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into a protocol-shaped body."""

    async def on_gmlx(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GmlxError)
        if exc.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(exc, protocol_for(request.url.path))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc), protocol_for(request.url.path))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = RouteError(f"{request.method} {request.url.path}: {exc.detail}.", exc.status_code)
        return error_response(err, protocol_for(request.url.path))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        err = EngineError(f"Internal error: {type(exc).__name__}: {exc}.")
        return error_response(err, protocol_for(request.url.path))

    app.add_exception_handler(GmlxError, on_gmlx)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
