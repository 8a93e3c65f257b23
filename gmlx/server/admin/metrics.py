"""``GET /v1/metrics`` (also ``/metrics``): the runtime snapshot, or Prometheus text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine import metrics, threads

if TYPE_CHECKING:
    from gmlx.engine.residency import Registry
    from gmlx.engine.worker import ModelWorker

router = APIRouter()

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_snapshot(registry: Registry, started_at: float) -> dict[str, Any]:
    """The ``/v1/metrics`` document (its sections under ``server``): every resident
    model, the shared governor (measured now) and the boot capacity table (null when
    there is none)."""

    def markers(worker: ModelWorker) -> dict[str, Any]:
        spec = registry.specs.get(worker.loaded.id)
        return {
            "pinned": bool(spec and spec.pinned),
            "kept": registry.kept(worker.loaded.id),
            "profile": spec.profile if spec else None,
        }

    def governor() -> dict[str, Any]:
        registry.governor.update()
        return registry.governor.snapshot()

    def headroom() -> int | None:
        # The governor's own measure (its probe), also when it is off.
        gov = registry.governor
        if gov.enabled:
            gov.update()
            if gov.headroom_bytes is not None:
                return gov.headroom_bytes
        return int(registry.probe())

    def table() -> dict[str, Any] | None:
        if registry.capacity is None:
            return None
        return {"model": registry.capacity_model, **registry.capacity.as_dict()}

    return metrics.snapshot(
        registry.workers(),
        started_at=started_at,
        model_extra=markers,
        governor=governor,
        capacity=table,
        headroom=headroom,
    )


@router.get("/v1/metrics", response_model=None)
@router.get("/metrics", response_model=None)
async def get_metrics(
    request: Request, format: Literal["json", "prometheus"] = Query("json")
) -> Response:
    """The snapshot as JSON, or with ``?format=prometheus`` as Prometheus gauges."""
    registry: Registry = request.app.state.registry
    # Off the loop: the memory probes call into MLX and psutil.
    snap = await threads.run(build_snapshot, registry, request.app.state.started_mono)
    if format == "prometheus":
        return Response(metrics.render_prometheus(snap), media_type=PROMETHEUS_TYPE)
    return JSONResponse(snap)
