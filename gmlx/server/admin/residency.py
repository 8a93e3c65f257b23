"""Residency routes: ``POST /unload``, ``POST /v1/keep`` and ``POST /v1/reload``.

They act on the engine's registry (:mod:`gmlx.engine.residency`): unload a model (409
while it streams; a pinned one stays pinned and loads again on its next request), keep
one resident past its idle timeout and warm it, and re-read the config file.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from gmlx.engine import threads
from gmlx.engine.errors import ConfigError, InvalidRequestError
from gmlx.server.schemas import REQUEST_CONFIG, documented, json_body

if TYPE_CHECKING:
    from gmlx.engine.residency import Registry

router = APIRouter()


class UnloadRequest(BaseModel):
    model_config = REQUEST_CONFIG

    model: str | None = None  # none: every idle model


class KeepRequest(BaseModel):
    model_config = REQUEST_CONFIG

    model: str = ""  # empty: the default (or sole) model
    keep: bool = True  # false releases the model to its idle timeout
    warm: bool = True  # run its decode shapes once, so the first request finds them compiled


@router.post("/unload", openapi_extra=documented(UnloadRequest))
async def unload(
    request: Request, body: Annotated[UnloadRequest, Depends(json_body(UnloadRequest))]
) -> dict[str, Any]:
    """Unload the model the body names (nothing when it is not resident), or every idle
    model. ModelBusyError (409) while that model streams."""
    registry: Registry = request.app.state.registry
    if body.model:
        model_id = registry.address(body.model).spec.id
        unloaded = [model_id] if await threads.run(registry.unload, model_id) else []
    else:
        unloaded = await threads.run(registry.unload_idle)
    return {"object": "unload", "unloaded": unloaded}


@router.post("/v1/keep", openapi_extra=documented(KeepRequest))
async def keep(
    request: Request, body: Annotated[KeepRequest, Depends(json_body(KeepRequest))]
) -> dict[str, Any]:
    """Keep a model resident past its idle timeout, loading it (through the load gate)
    and warming it; ``keep: false`` releases it and never loads."""
    registry: Registry = request.app.state.registry
    model_id = registry.address(body.model).spec.id
    result = await threads.run(registry.keep, model_id, body.keep, body.warm)
    return {"object": "keep", **asdict(result)}


@router.post("/v1/reload")
async def reload(request: Request) -> dict[str, Any]:
    """Re-read the config file: added models appear, removed ones unload once idle, and
    entries whose load parameters did not change stay resident. ``{"status":
    "unsupported"}`` when the server runs without a config file."""
    state = request.app.state
    outcome = None
    if state.reload is not None:
        try:
            outcome = await threads.run(state.reload, state.settings)
        except ConfigError as e:
            raise InvalidRequestError(
                f"{e.message} The running configuration is unchanged.", param=None
            ) from e
    if outcome is None:
        return {"status": "unsupported"}
    state.settings, result = outcome
    return {"status": "ok", **asdict(result)}
