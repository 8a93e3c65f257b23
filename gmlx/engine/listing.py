"""The model listing's rows: each served id and alias with its markers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gmlx.engine.loading import progress

if TYPE_CHECKING:
    from gmlx.engine.addressing import Target
    from gmlx.engine.residents import Resident


@dataclass(frozen=True)
class ModelInfo:
    """One row of the model listing: a model id, or an alias with ``alias_of`` set."""

    id: str
    resident: bool
    pinned: bool
    speculative: bool
    vlm: bool  # the model's vision part is loaded: it takes images now
    profile: str | None
    default: bool
    context_length: int | None
    max_context_at_width_1: int | None = None
    alias_of: str | None = None
    kept: bool = False
    in_flight: int = 0
    waiting: int = 0
    weight_bytes: int | None = None  # measured, while resident
    idle_s: float | None = None  # seconds since last use, while resident and idle
    loading: dict[str, Any] | None = None  # while it loads: {phase, done, total}
    kv_bytes_per_token: int | None = None  # while resident: KV bytes one more token costs
    kv_quant: dict[str, Any] | None = None  # while resident with kv_quant configured


def model_info(
    name: str,
    target: Target,
    entry: Resident | None,
    *,
    context_length: int | None,
    at_width_1: int | None,
    now: float,
    alias_of: str | None = None,
) -> ModelInfo:
    """The row of ``name`` (a model id, or an alias of ``alias_of``) addressing
    ``target``, whose model is resident as ``entry`` (None: not loaded)."""
    spec = target.spec
    worker = entry.worker if entry is not None else None
    return ModelInfo(
        id=name,
        resident=entry is not None,
        pinned=spec.pinned,
        speculative=spec.draft is not None,
        vlm=worker is not None and worker.loaded.vision is not None,
        profile=target.profile_name,
        default=spec.default and alias_of is None,
        context_length=context_length,
        max_context_at_width_1=at_width_1,
        alias_of=alias_of,
        kept=entry is not None and entry.kept,
        in_flight=worker.in_flight if worker else 0,
        waiting=worker.waiting if worker else 0,
        weight_bytes=worker.weight_bytes if worker else None,
        idle_s=entry.idle_s(now) if entry is not None else None,
        loading=_loading(spec.id) if entry is None else None,
        kv_bytes_per_token=_kv_bytes_per_token(entry),
        kv_quant=_kv_quant(entry),
    )


def _kv_bytes_per_token(entry: Resident | None) -> int | None:
    """What one more token of context costs the resident model, at its KV's width."""
    if entry is None:
        return None
    if entry.geometry is not None:
        return entry.geometry.kv_bytes_per_token
    return entry.table.kv_bytes_per_token if entry.table is not None else None


def _kv_quant(entry: Resident | None) -> dict[str, Any] | None:
    if entry is None or entry.spec.kv_quant is None:
        return None
    from gmlx.engine.kv_layers import describe

    return describe(entry.worker.loaded, entry.spec.kv_quant, entry.worker.kv_quant is not None)


def _loading(model_id: str) -> dict[str, Any] | None:
    if (s := progress.status(model_id)) is None:
        return None
    return {"phase": s.phase, "done": s.done, "total": s.total}
