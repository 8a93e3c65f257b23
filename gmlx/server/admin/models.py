"""``GET /v1/models`` (also ``/models``): served ids and aliases with their markers."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request

from gmlx.engine.residency import Registry

router = APIRouter()


@router.get("/v1/models")
@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """Every configured model, then every alias (``alias_of`` names its model)."""
    registry: Registry = request.app.state.registry
    created: int = request.app.state.started_at
    return {
        "object": "list",
        "data": [
            {"object": "model", "created": created, "owned_by": "gmlx", **asdict(info)}
            for info in registry.listing()
        ],
    }
