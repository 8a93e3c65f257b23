"""The runtime snapshot behind ``/v1/metrics``, and its Prometheus rendering.

The document is one object, ``server``: the process (``pid``, ``uptime_s``) and the
spec's sections beside them (``concurrency``, ``queue``, ``requests``,
``resident_models``, ``governor``, ``memory``, ``capacity``, ``rates``) and
``counters`` (requests finished by outcome, and refused), so a client reads
``server.concurrency.in_flight``. Each section is computed on its own: a probe
that fails leaves that section's live fields null and the rest of the snapshot intact.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gmlx.engine.worker import ModelWorker

log = logging.getLogger("gmlx.metrics")

BANDS = ("green", "yellow", "orange", "red")

# What each section holds when its probe fails: the same keys, all null.
EMPTY_SECTIONS: dict[str, dict[str, Any]] = {
    "concurrency": dict.fromkeys(("decode_batch", "queue_cap", "in_flight", "waiting")),
    "queue": dict.fromkeys(("waiting", "cap", "eta_s", "rejections", "last_reject_reason")),
    "governor": dict.fromkeys(("enabled", "band", "sheds", "admission_paused")),
    "memory": dict.fromkeys(("active_bytes", "cache_bytes", "peak_bytes", "headroom_bytes", "total_bytes")),
    "rates": dict.fromkeys(
        ("decode_tok_s", "decode_streams", "prefill_tok_s_recent", "decode_tok_s_recent", "decode_tok_s_lifetime")
    ),
    "counters": dict.fromkeys(("finished", "completed", "cancelled", "shed", "errors", "refused")),
}

# Finish reasons that mean the request got its answer (to its end, its cap, or its calls).
_COMPLETED = ("stop", "length", "tool_calls")


def _section(name: str, probe: Callable[[], Any]) -> Any:
    try:
        return probe()
    except Exception:  # one failing probe must not take the snapshot down
        log.exception("metrics section %s failed", name)
        empty = EMPTY_SECTIONS.get(name)
        return dict(empty) if empty is not None else None


def concurrency(workers: Sequence[ModelWorker]) -> dict[str, Any]:
    return {
        "decode_batch": max((w.decode_batch for w in workers), default=None),
        "queue_cap": max((w.queue_cap for w in workers), default=None),
        "in_flight": sum(w.in_flight for w in workers),
        "waiting": sum(w.waiting for w in workers),
    }


def queue(workers: Sequence[ModelWorker]) -> dict[str, Any]:
    from gmlx.engine.scheduling import retry_after_s

    reasons = [w.stats.last_reject_reason for w in workers if w.stats.last_reject_reason]
    # What a refusal's Retry-After would carry now (same estimate, same clamp); 0 when
    # nothing waits beyond the free slots, as no refusal would come.
    eta = max((w.queue_eta_s() for w in workers), default=0.0)
    return {
        "waiting": sum(w.waiting for w in workers),
        "cap": max((w.queue_cap for w in workers), default=None),
        "eta_s": retry_after_s(eta) if eta > 0 else 0,
        "rejections": sum(w.stats.rejections for w in workers),
        "last_reject_reason": reasons[-1] if reasons else None,
    }


def requests(workers: Sequence[ModelWorker]) -> list[dict[str, Any]]:
    rows = [row for w in workers for row in w.rows()]
    return sorted(rows, key=lambda r: r["state"] != "queued")  # stable: queued rows first


def memory(headroom: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """MLX's memory figures; ``headroom_bytes`` is what ``headroom`` measures (the
    governor's probe, on every backend), else the capacity model's free working set."""
    import mlx.core as mx
    import psutil

    from gmlx.engine import capacity

    return {
        "active_bytes": mx.get_active_memory(),
        "cache_bytes": mx.get_cache_memory(),
        "peak_bytes": mx.get_peak_memory(),
        "headroom_bytes": headroom() if headroom is not None else capacity.free_bytes(),
        "total_bytes": int(psutil.virtual_memory().total),
    }


def rates(workers: Sequence[ModelWorker]) -> dict[str, Any]:
    per = [w.stats.rates() for w in workers]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in per if r[key] is not None]
        return round(sum(vals) / len(vals), 2) if vals else None

    return {
        "decode_tok_s": round(sum(r["decode_tok_s"] or 0.0 for r in per), 2),
        "decode_streams": sum(r["decode_streams"] for r in per),
        "prefill_tok_s_recent": mean("prefill_tok_s_recent"),
        "decode_tok_s_recent": mean("decode_tok_s_recent"),
        "decode_tok_s_lifetime": mean("decode_tok_s_lifetime"),
    }


def model_row(worker: ModelWorker, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cache = worker.prompt_cache.stats()
    return {
        "id": worker.loaded.id,
        "in_flight": worker.in_flight,
        "waiting": worker.waiting,
        "decode_batch": worker.decode_batch,
        "pinned": False,
        "kept": False,
        "weight_bytes": worker.weight_bytes,
        "prompt_cache_bytes": cache["bytes"],
        **(extra or {}),
    }


def snapshot(
    workers: Sequence[ModelWorker],
    *,
    started_at: float,
    model_extra: Callable[[ModelWorker], dict[str, Any]] | None = None,
    governor: Callable[[], dict[str, Any]] | None = None,
    capacity: Callable[[], dict[str, Any] | None] | None = None,
    headroom: Callable[[], int | None] | None = None,
) -> dict[str, Any]:
    """The whole ``/v1/metrics`` document for the resident ``workers``: ``{"server":
    {...}}``, the sections under ``server`` (see the module docstring); ``headroom``
    measures ``memory.headroom_bytes`` (the governor's probe)."""
    workers = list(workers)
    return {
        "server": {
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - started_at, 1),
            "concurrency": _section("concurrency", lambda: concurrency(workers)),
            "queue": _section("queue", lambda: queue(workers)),
            "requests": _section("requests", lambda: requests(workers)) or [],
            "resident_models": _section(
                "resident_models",
                lambda: [model_row(w, model_extra(w) if model_extra else None) for w in workers],
            )
            or [],
            "governor": _section(
                "governor", governor or (lambda: {**EMPTY_SECTIONS["governor"], "enabled": False})
            ),
            "memory": _section("memory", lambda: memory(headroom)),
            "capacity": _section("capacity", capacity or (lambda: None)),
            "rates": _section("rates", lambda: rates(workers)),
            "counters": _section("counters", lambda: counters(workers)),
        }
    }


def counters(workers: Sequence[ModelWorker]) -> dict[str, int]:
    """Requests the resident models finished since they loaded, by outcome, and the
    requests the queue refused: ``completed`` (answered to the end, the cap or a tool
    call), ``cancelled``, ``shed`` by the governor, ``errors``."""
    reasons: dict[str, int] = {}
    for w in workers:
        for reason, n in dict(w.stats.finish_reasons).items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        "finished": sum(reasons.values()),
        "completed": sum(reasons.get(r, 0) for r in _COMPLETED),
        "cancelled": reasons.get("cancelled", 0),
        "shed": reasons.get("shed", 0),
        "errors": reasons.get("error", 0),
        "refused": sum(w.stats.rejections for w in workers),
    }


# -- Prometheus -----------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def _families(snap: dict[str, Any]) -> Iterable[Any]:
    from prometheus_client.core import GaugeMetricFamily

    # Gauges are named for the section alone (gmlx_concurrency_in_flight): every
    # section lives under ``server``, so the prefix would add nothing.
    snap = snap.get("server") or {}
    for section in ("concurrency", "queue", "memory", "rates", "counters"):
        for key, value in (snap.get(section) or {}).items():
            if (num := _number(value)) is not None:
                yield GaugeMetricFamily(f"gmlx_{section}_{key}", f"{section}.{key}", value=num)

    yield GaugeMetricFamily("gmlx_requests", "Live requests (queued and running).",
                            value=len(snap.get("requests") or []))

    gov = snap.get("governor") or {}
    band = GaugeMetricFamily("gmlx_governor_band", "1 for the governor's current band.", labels=["band"])
    for name in BANDS:
        band.add_metric([name], 1.0 if gov.get("band") == name else 0.0)
    yield band
    for key, value in gov.items():
        if key != "band" and (num := _number(value)) is not None:
            yield GaugeMetricFamily(f"gmlx_governor_{key}", f"governor.{key}", value=num)

    cap = snap.get("capacity") or {}
    max_ctx = GaugeMetricFamily("gmlx_capacity_max_ctx", "Most context per stream at a width.", labels=["width"])
    for width, ctx in (cap.get("max_ctx") or {}).items():
        if (num := _number(ctx)) is not None:
            max_ctx.add_metric([str(width)], num)
    yield max_ctx

    models = snap.get("resident_models") or []
    keys = sorted({k for m in models for k, v in m.items() if _number(v) is not None})
    for key in keys:
        # A series carries a profile label only when its model has a profile.
        fam = GaugeMetricFamily(f"gmlx_model_{key}", f"resident_models[].{key}")
        for m in models:
            if (num := _number(m.get(key))) is not None:
                labels = {"model": m["id"], **({"profile": m["profile"]} if m.get("profile") else {})}
                fam.add_sample(fam.name, labels, num)
        yield fam


def render_prometheus(snap: dict[str, Any]) -> bytes:
    """The snapshot (as :func:`snapshot` returns it) as Prometheus text exposition: its
    sections flattened to gauges, ``requests[]`` as a count only."""
    from prometheus_client import CollectorRegistry, generate_latest

    class _Collector:
        def collect(self) -> Iterable[Any]:
            return _families(snap)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)
