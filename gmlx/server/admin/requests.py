"""``POST /v1/requests/{id}/cancel`` and ``DELETE /v1/requests/{id}``: stop a request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from gmlx.engine.errors import GmlxError

if TYPE_CHECKING:
    from gmlx.engine.residency import Registry

router = APIRouter()

# The ids responses carry: chat and completions wrap the engine id (without ``req-``)
# in these prefixes; the ``x-request-id`` header carries it whole.
PROTOCOL_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")
ENGINE_PREFIX = "req-"


class RequestNotFoundError(GmlxError):
    """No running or queued request has this id."""

    status = 404
    openai_type = "not_found_error"
    anthropic_type = "not_found_error"
    code = "request_not_found"


def engine_id(request_id: str) -> str:
    """The engine id for any form a client holds: ``req-X``, ``X`` or a response id."""
    for prefix in PROTOCOL_PREFIXES:
        if request_id.startswith(prefix):
            request_id = request_id.removeprefix(prefix)
            break
    return request_id if request_id.startswith(ENGINE_PREFIX) else ENGINE_PREFIX + request_id


def cancel(registry: Registry, request_id: str) -> dict[str, Any]:
    """Cancel a live request on whichever worker holds it; its stream ends with a
    ``cancelled`` finish at the worker's next step. Raises RequestNotFoundError."""
    rid = engine_id(request_id)
    for worker in registry.workers():
        if worker.has_request(rid):
            worker.cancel(rid)
            return {"id": rid, "object": "request", "model": worker.loaded.id, "cancelled": True}
    raise RequestNotFoundError(
        f"No running or queued request has id {request_id!r}; it may have finished already.",
        param="request_id",
    )


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, request: Request) -> dict[str, Any]:
    """Cancel a queued or running request."""
    return cancel(request.app.state.registry, request_id)


@router.delete("/v1/requests/{request_id}")
async def delete_request(request_id: str, request: Request) -> dict[str, Any]:
    """The same as the cancel route: a finished request leaves nothing to delete."""
    return cancel(request.app.state.registry, request_id)
