"""Every error the server returns, rendered once, in the protocol of the route.

Anthropic routes (``/v1/messages...``) get ``{"type": "error", "error": {"type",
"message"}}``; every other route gets OpenAI's ``{"error": {"message", "type",
"param", "code"}}``. Extra fields an error carries (``available_models``,
``valid_profiles``) go inside the inner ``error`` object in both shapes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
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


# The member tags pydantic puts in an error's location when a union fails ("str",
# "list[dict[str,any]]", "literal['a','b']"): types, not fields a client wrote.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def _field(loc: Sequence[Any]) -> tuple[str, ...]:
    return tuple(
        str(p) for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.match(p))
    )


def validation_error(exc: RequestValidationError | ValidationError) -> InvalidRequestError:
    """A pydantic validation failure as one sentence naming the field.

    A union reports one error per member; they become one sentence at the field
    (``Input should be a valid string or a valid list``), and when a member matched
    deeper (a list whose item is wrong) that deeper error is the one reported.
    """
    errors = list(exc.errors()) or [{"loc": (), "msg": "invalid body"}]
    top = _field(errors[0].get("loc", ()))
    related = [e for e in errors if _field(e.get("loc", ()))[: len(top)] == top]
    depth = max(len(_field(e.get("loc", ()))) for e in related)
    chosen = [e for e in related if len(_field(e.get("loc", ()))) == depth]
    field = ".".join(_field(chosen[0].get("loc", ())))
    prefix = "Input should be "
    msgs = list(dict.fromkeys(str(e.get("msg", "invalid value")) for e in chosen))
    if len(msgs) > 1 and all(m.startswith(prefix) for m in msgs):
        msgs = [prefix + " or ".join(m.removeprefix(prefix) for m in msgs)]
    where = f" at {field}" if field else ""
    more = len(errors) - len(related)
    extra = f" (and {more} more problems)" if more > 0 else ""
    return InvalidRequestError(
        f"Invalid request body{where}: {'; '.join(msgs)}{extra}.", param=field or None
    )


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into a protocol-shaped body."""

    async def on_gmlx(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GmlxError)
        if exc.status == 503:  # back-pressure the client is told to retry: expected under load
            log.warning("%s %s refused: %s", request.method, request.url.path, exc)
        elif exc.status >= 500:
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
