"""``GET /v1/status``: the server, its models, the engines and the memory governor."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from gmlx import __version__

if TYPE_CHECKING:
    from gmlx.config import Settings
    from gmlx.engine.residency import Registry

router = APIRouter()


def _engine(registry: Registry) -> dict[str, Any]:
    """Which backend runs MLX, the shared switches, and a one-word state."""
    from gmlx.engine import capacity

    workers = registry.workers()
    if not workers:
        state = "idle"
    elif any(w.waiting for w in workers):
        state = "queueing"
    elif any(w.in_flight for w in workers):
        state = "generating"
    else:
        state = "ready"
    return {
        "state": state,
        "backend": capacity.backend(),
        "python": platform.python_version(),
        "resident_models": len(workers),
        "in_flight": sum(w.in_flight for w in workers),
        "waiting": sum(w.waiting for w in workers),
        "prompt_cache": registry.prompt_cache_bytes != 0,
        "overcommit": registry.overcommit,
        "capacity_model": registry.capacity_model,
    }


@router.get("/v1/status")
async def status(request: Request) -> dict[str, Any]:
    """Server identity and uptime, every listed model (resident ones with their
    engine's ``in_flight``, ``waiting``, ``decode_batch`` and ``queue_cap``), the
    engine state and the governor's band."""
    registry: Registry = request.app.state.registry
    settings: Settings = request.app.state.settings
    bound = request.scope.get("server") or (settings.server.host, settings.server.port)
    models = []
    for info in registry.listing():
        row = asdict(info)
        worker = registry.resident_worker(info.alias_of or info.id)
        if worker is not None:
            row.update(
                in_flight=worker.in_flight,
                waiting=worker.waiting,
                decode_batch=worker.decode_batch,
                queue_cap=worker.queue_cap,
            )
        models.append(row)
    registry.governor.update()
    return {
        "object": "status",
        "server": {
            "version": __version__,
            "pid": os.getpid(),
            "started_at": request.app.state.started_at,
            "uptime_s": round(time.monotonic() - request.app.state.started_mono, 1),
            "host": bound[0],
            "port": bound[1],
            "config": settings.origin,
        },
        "models": models,
        "engine": _engine(registry),
        "governor": registry.governor.snapshot(),
    }
