"""Admission: will a request fit, how long until its first token, may a fan-out start.

One computation serves every place that asks: the memory preflight before a request
is submitted, ``POST /v1/estimate`` and ``"dry_run": true``, ``GET
/v1/capacity/plan``, and ``gmlx estimate`` / ``gmlx plan`` run offline. Each answer
is a dataclass; front ends only serialise it.

The estimate prices a rendered prompt with ``capacity.request_need`` against the
memory free now and the drained working set (free memory plus the KV the running
requests hold), peeking at the prompt cache (never fetching from it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from gmlx.engine import capacity
from gmlx.engine.errors import PromptTooLongError
from gmlx.engine.governor import Band
from gmlx.engine.scheduling import DEFAULT_REQUEST_S

if TYPE_CHECKING:
    from gmlx.engine.kv_quant import KVQuant
    from gmlx.engine.residency import Registry
    from gmlx.engine.worker import ModelWorker

# Prefill rate assumed before a model has finished a request to measure: low, so a
# dispatcher that knows nothing yet expects a slow first token rather than a fast one.
DEFAULT_PREFILL_TOK_S = 50.0


@dataclass(frozen=True)
class Estimate:
    """The admission estimate of one request (the ``/v1/estimate`` answer).

    Token and memory fields are None for a model that is not resident (counting
    tokens needs its tokenizer, and a dry run never loads a model), and memory
    fields are None where the model's geometry or the free memory is unknown.
    """

    model: str
    resident: bool | None
    prompt_tokens: int | None
    warm_tokens: int | None
    cache_tier: str | None
    max_tokens: int | None
    need_bytes: int | None
    free_bytes: int | None
    drained_bytes: int | None
    fits_now: bool | None
    fits_drained: bool | None
    context_ok: bool | None
    context_limit: int | None
    est_ttft_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"object": "estimate", **asdict(self)}


def estimate(
    registry: Registry, worker: ModelWorker, ids: Sequence[int], max_tokens: int | None, model: str,
    cache_ids: Sequence[int] | None = None,
) -> Estimate:
    """The estimate of a prompt (``ids``, rendered for ``worker``'s model).

    ``max_tokens`` is the output cap the request pins (None: unpinned, so only the
    prompt's KV is priced); ``model`` is the name the answer reports; ``cache_ids``
    what the prompt cache knows the prompt by, where not ``ids`` (images by digest).
    """
    n = len(ids)
    tier, warm = worker.prompt_cache.peek(list(cache_ids or ids))
    limit = worker.loaded.context_length
    geom = registry.geometry(worker.loaded.id)
    need = (
        capacity.request_need(
            geom, n, max_tokens=max_tokens, chunk=worker.prefill_step_size, warm_tokens=warm
        ).need_bytes
        if geom is not None
        else None
    )
    free = registry.free_bytes()
    drained = free + registry.running_kv_bytes() if free is not None else None
    return Estimate(
        model=model,
        resident=True,
        prompt_tokens=n,
        warm_tokens=warm,
        cache_tier=tier,
        max_tokens=max_tokens,
        need_bytes=need,
        free_bytes=free,
        drained_bytes=drained,
        fits_now=need <= free if need is not None and free is not None else None,
        fits_drained=need <= drained if need is not None and drained is not None else None,
        context_ok=n + (max_tokens or 1) <= limit,
        context_limit=limit,
        est_ttft_s=round(ttft_s(worker, n - warm), 3),
    )


def not_resident(model: str, max_tokens: int | None, context_limit: int | None) -> Estimate:
    """The estimate for a model that is not loaded: nothing can be counted yet."""
    return Estimate(
        model=model,
        resident=False,
        prompt_tokens=None,
        warm_tokens=None,
        cache_tier=None,
        max_tokens=max_tokens,
        need_bytes=None,
        free_bytes=None,
        drained_bytes=None,
        fits_now=None,
        fits_drained=None,
        context_ok=None,
        context_limit=context_limit,
        est_ttft_s=None,
    )


def ttft_s(worker: ModelWorker, cold_tokens: int) -> float:
    """The wait for a slot at the recent pace, plus the cold prompt at the recent
    prefill rate (or the conservative defaults before anything was measured)."""
    ahead = worker.waiting_for_slot
    wait = 0.0
    if ahead >= worker.free_slots:  # every slot will be taken before this request's turn
        per_request = worker.stats.mean_request_s() or DEFAULT_REQUEST_S
        wait = per_request * math.ceil((ahead - worker.free_slots + 1) / worker.decode_batch)
    rate = worker.stats.rates()["prefill_tok_s_recent"] or DEFAULT_PREFILL_TOK_S
    return wait + max(0, cold_tokens) / rate


def preflight(
    registry: Registry, worker: ModelWorker, ids: Sequence[int], max_tokens: int | None,
    cache_ids: Sequence[int] | None = None,
) -> None:
    """Refuse a request that cannot fit in memory even once the running requests
    finish: PromptTooLongError (a 400) whose message starts ``prompt is too long`` and
    carries the estimated need and the available budget.

    ``max_tokens`` is the cap the request pins (None: unpinned). Does nothing when
    the model's geometry or the free memory is unknown.
    """
    geom = registry.geometry(worker.loaded.id)
    free = registry.free_bytes()
    if geom is None or free is None:
        return
    n = len(ids)
    budget = free + registry.running_kv_bytes()

    def need_bytes(warm: int) -> int:
        return capacity.request_need(
            geom, n, max_tokens=max_tokens, chunk=worker.prefill_step_size, warm_tokens=warm
        ).need_bytes

    need = need_bytes(0)
    if need > budget:  # too big as a miss: a cached prefix may still make it fit
        need = need_bytes(worker.prompt_cache.peek(list(cache_ids or ids))[1])
    if need > budget:
        output = f" + {max_tokens} max_tokens" if max_tokens else ""
        raise PromptTooLongError(
            f"prompt is too long for the memory available: {n} prompt tokens{output} need an "
            f"estimated {capacity.human(need)} ({need} bytes), but the available budget is "
            f"{capacity.human(budget)} ({budget} bytes).",
            param="messages",
        )


# -- fan-out plans ----------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Whether ``width`` streams of ``depth`` tokens fit (``ok``: None without a
    table to judge by) and may start now (``admit_now``: None where nothing runs,
    offline); ``reason`` names the first condition that fails."""

    width: int
    depth: int
    model: str | None
    ok: bool | None
    admit_now: bool | None
    reason: str | None
    detail: str | None
    table_width: int | None
    max_ctx: int | None
    band: str | None = None
    waiting: int = 0
    in_flight: int = 0
    decode_batch: int | None = None
    free_slots: int = 0
    counted_slots: int = 0
    # Offline plans (``gmlx plan MODEL``) also report the table's figures.
    max_width_at_depth: int | None = None
    budget_bytes: int | None = None
    weight_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    context_length: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON: a server's has the engine's live fields, an offline one
        (``admit_now`` None: nothing runs) the table's figures instead."""
        out = asdict(self)
        for name in _LIVE_FIELDS if self.admit_now is None else _OFFLINE_FIELDS:
            out.pop(name, None)
        return out


_LIVE_FIELDS = ("band", "waiting", "in_flight", "decode_batch", "free_slots", "counted_slots")
_OFFLINE_FIELDS = ("max_width_at_depth", "budget_bytes", "weight_bytes", "kv_bytes_per_token",
                   "context_length")


def plan(registry: Registry, width: int, depth: int, worker: ModelWorker | None) -> Plan:
    """The plan on a server: the boot table read at the smallest tabulated width at
    or above ``width`` (``ok``), and whether ``worker``'s engine may take the fan-out
    now: the governor not orange or red, nothing waiting, ``width`` slots free (one
    counted under a yellow band). Without a table (or under overcommit) ``ok`` is
    None and ``admit_now`` judges only the timing.
    """
    table = registry.table_for_requests()
    ok: bool | None = None
    detail: str | None = None
    if table is not None:
        ok, detail = capacity.plan(table, width, depth)
    gov = registry.governor
    gov.update()
    band = gov.band if gov.enabled else None
    waiting = worker.waiting if worker else 0
    free = worker.free_slots if worker else 0
    counted = min(free, 1) if band is Band.YELLOW else free

    reason: str | None = None
    if ok is False:
        reason = "geometry"
    elif band in (Band.ORANGE, Band.RED):
        reason, detail = "pressure", f"the memory governor is {band.value}"
    elif worker is None:
        reason, detail = "not_resident", "the model is not loaded"
    elif waiting:
        reason, detail = "queue", f"{waiting} requests are waiting for a slot"
    elif counted < width:
        yellow = " (one counted under a yellow band)" if band is Band.YELLOW else ""
        reason, detail = "slots", f"{free} decode slots are free{yellow}, {width} needed"
    return Plan(
        width=width,
        depth=depth,
        model=worker.loaded.id if worker else registry.capacity_model,
        ok=ok,
        admit_now=reason is None,
        reason=reason,
        detail=detail if reason else None,
        table_width=table.width_at(width) if table is not None else None,
        max_ctx=table.max_ctx_at(width) if table is not None else None,
        band=band.value if band else None,
        waiting=waiting,
        in_flight=worker.in_flight if worker else 0,
        decode_batch=worker.decode_batch if worker else None,
        free_slots=free,
        counted_slots=counted,
    )


def offline_plan(registry: Registry, width: int, depth: int, worker: ModelWorker,
                 kv_quant: KVQuant | None = None) -> Plan:
    """The plan for a model loaded in this process (``gmlx plan MODEL``): its table
    against this machine's free memory; nothing runs, so ``admit_now`` is None. With
    ``kv_quant``, the plan as it would be with the model's full KV layers quantized so
    (same budget and prefill chunk, KV priced at the quantized width)."""
    table = registry.capacity
    geom = registry.geometry(worker.loaded.id)
    if table is None or geom is None:
        return Plan(width, depth, worker.loaded.id, ok=None, admit_now=None, reason="no_table",
                    detail="the model's memory geometry cannot be measured",
                    table_width=None, max_ctx=None)
    if kv_quant is not None:
        from gmlx.engine.capacity import quantized_geometry

        geom = quantized_geometry(geom, worker.loaded.config, kv_quant)
        table = capacity.capacity_table(geom, table.budget_bytes, table.chunk)
    ok, detail = capacity.plan(table, width, depth)
    return Plan(
        width=width,
        depth=depth,
        model=worker.loaded.id,
        ok=ok,
        admit_now=None,
        reason=None if ok else "geometry",
        detail=detail,
        table_width=table.width_at(width),
        max_ctx=table.max_ctx_at(width),
        max_width_at_depth=capacity.max_width(geom, depth, table.budget_bytes, table.chunk),
        budget_bytes=table.budget_bytes,
        weight_bytes=table.weight_bytes,
        kv_bytes_per_token=table.kv_bytes_per_token,
        context_length=geom.context_length,
    )
