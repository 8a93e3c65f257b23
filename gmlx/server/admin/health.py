"""``GET /health``: liveness, and with ``?ready=1`` a coarse readiness verdict."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gmlx.engine.governor import Band
from gmlx.engine.residency import Registry

router = APIRouter()

# Memory clears slower than slots, and a model takes seconds to load.
RETRY_AFTER_S = {"loading": "5", "pressure": "5", "queue": "1", "busy": "1"}


@router.get("/health", response_model=None)
async def health(request: Request, ready: bool = False) -> dict[str, Any] | JSONResponse:
    """Exactly ``{"status": "healthy", "pid": N}``; ``ready=1`` adds ``ready``, or
    answers 503 with a one-word ``reason`` (``loading``: the startup models, or a
    model a request asked for, are still loading; ``pressure``: the memory governor is
    orange or red; ``queue``: requests wait; ``busy``: every loaded model decodes at
    full width), the first that holds, and ``Retry-After``.
    """
    body: dict[str, Any] = {"status": "healthy", "pid": os.getpid()}
    if not ready:
        return body
    registry: Registry = request.app.state.registry
    workers = registry.workers()
    reason = None
    governor = registry.governor
    starting = request.app.state.starting
    if (starting is not None and not starting.done()) or registry.loading():
        reason = "loading"
    elif governor.enabled and governor.update() in (Band.ORANGE, Band.RED):
        reason = "pressure"
    elif any(w.waiting for w in workers):
        reason = "queue"
    elif workers and all(w.in_flight >= w.decode_batch for w in workers):
        reason = "busy"
    if reason is None:
        return {**body, "ready": True}
    return JSONResponse(
        {**body, "ready": False, "reason": reason},
        status_code=503,
        headers={"Retry-After": RETRY_AFTER_S[reason]},
    )
