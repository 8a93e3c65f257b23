"""The prompt cache routes: ``GET /v1/cache/stats``, ``POST /v1/cache/reset``,
``DELETE /v1/cache`` and ``DELETE /v1/cache/prefix``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from gmlx.server.schemas import documented, json_body

if TYPE_CHECKING:
    from gmlx.engine.residency import Registry

router = APIRouter()

SUMMED = ("hits", "misses", "tokens_reused", "bytes", "max_bytes", "entries")


class ResetBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None


def _enabled(registry: Registry) -> bool:
    return registry.prompt_cache_bytes != 0


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> dict[str, Any]:
    """Per resident model statistics and their totals; exactly ``{"enabled": false}``
    when the prompt cache is off (``GMLX_PROMPT_CACHE_BYTES=0``)."""
    registry: Registry = request.app.state.registry
    if not _enabled(registry):
        return {"enabled": False}
    models = {w.loaded.id: w.prompt_cache.stats() for w in registry.workers()}
    totals: dict[str, Any] = {key: sum(s[key] for s in models.values()) for key in SUMMED}
    tiers: dict[str, int] = {}
    for s in models.values():
        for tier, count in s["tiers"].items():
            tiers[tier] = tiers.get(tier, 0) + count
    totals["tiers"] = tiers
    lookups = totals["hits"] + totals["misses"]
    totals["hit_rate"] = round(totals["hits"] / lookups, 4) if lookups else None
    return {"enabled": True, "models": models, "totals": totals}


def _reset(registry: Registry, model: str | None) -> dict[str, Any]:
    """Clear the cached prefixes of one model (any addressable name) or of all resident
    models; the hit counters are lifetime figures and stay. Raises ModelNotFoundError."""
    if model:
        worker = registry.resident_worker(registry.address(model).spec.id)
        workers = [worker] if worker is not None else []
    else:
        workers = registry.workers()
    for worker in workers:
        worker.prompt_cache.reset()
    return {"status": "ok", "reset": [w.loaded.id for w in workers]}


@router.post("/v1/cache/reset", openapi_extra=documented(ResetBody))
async def cache_reset(request: Request) -> dict[str, Any]:
    """Clear the prompt cache of every resident model, or of ``{"model": "<id>"}``
    (404 ``model_not_found`` for an unknown id; a configured model that is not
    resident has nothing to clear)."""
    body = await json_body(ResetBody)(request)
    return _reset(request.app.state.registry, body.model)


@router.delete("/v1/cache")
@router.delete("/v1/cache/prefix")
async def cache_clear(request: Request) -> dict[str, Any]:
    """Clear every engine cache; the prompt (prefix) cache is the only one."""
    return _reset(request.app.state.registry, None)
