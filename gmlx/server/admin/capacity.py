"""Admission before generation: ``POST /v1/estimate``, ``GET /v1/capacity/plan`` and
the memory preflight that generation runs before submitting a request.

The estimate, the ``dry_run`` answer of ``/v1/chat/completions`` and the preflight
share one computation (:func:`estimate`): the prompt is rendered and tokenized
exactly as the chat route does it, the prompt cache is peeked (never fetched), and
``capacity.request_need`` prices the request against the memory free now and the
drained working set (free memory plus the KV the running requests hold).

None of these routes loads a model. For a model that is not resident the estimate
answers ``resident: false`` and leaves the token and memory fields null: counting
tokens needs the model's tokenizer and chat template, and loading even the tokenizer
of a large GGUF can take seconds and memory that a dry run should not spend.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request

from gmlx.engine import capacity
from gmlx.engine.errors import InvalidRequestError, PromptTooLongError
from gmlx.engine.governor import Band
from gmlx.engine.tools import apply_tool_choice
from gmlx.server import generation
from gmlx.server.openai import translate
from gmlx.server.openai.schemas import ChatBody

if TYPE_CHECKING:
    from gmlx.engine.residency import Registry
    from gmlx.engine.worker import ModelWorker
    from gmlx.server.generation import Rendered
    from gmlx.server.openai.schemas import ChatCompletionRequest

router = APIRouter()

# Prefill rate assumed before a model has finished a request to measure: low, so a
# dispatcher that knows nothing yet expects a slow first token rather than a fast one.
DEFAULT_PREFILL_TOK_S = 50.0
DEFAULT_REQUEST_S = 5.0  # the worker's own assumption for a request's duration


# -- the shared estimate ------------------------------------------------------------


def estimate(registry: Registry, rendered: Rendered, max_tokens: int | None) -> dict[str, Any]:
    """The admission estimate of a rendered request on its resident model.

    ``max_tokens`` is the output cap the body pins (None: unpinned, so only the
    prompt's KV is priced). Memory fields are null when the model's geometry could
    not be measured or the free-memory probe fails.
    """
    worker = rendered.worker
    n = len(rendered.ids)
    tier, warm = worker.prompt_cache.peek(list(rendered.ids))
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
    return {
        "object": "estimate",
        "model": rendered.model,
        "resident": True,
        "prompt_tokens": n,
        "warm_tokens": warm,
        "cache_tier": tier,
        "max_tokens": max_tokens,
        "need_bytes": need,
        "free_bytes": free,
        "drained_bytes": drained,
        "fits_now": need <= free if need is not None and free is not None else None,
        "fits_drained": need <= drained if need is not None and drained is not None else None,
        "context_ok": n + (max_tokens or 1) <= limit,
        "context_limit": limit,
        "est_ttft_s": round(_ttft_s(worker, n - warm), 3),
    }


def _ttft_s(worker: ModelWorker, cold_tokens: int) -> float:
    """The wait for a slot at the recent pace, plus the cold prompt at the recent
    prefill rate (or the conservative defaults before anything was measured)."""
    ahead = worker.waiting_for_slot
    wait = 0.0
    if ahead >= worker.free_slots:  # every slot will be taken before this request's turn
        per_request = worker.stats.mean_request_s() or DEFAULT_REQUEST_S
        wait = per_request * math.ceil((ahead - worker.free_slots + 1) / worker.decode_batch)
    rate = worker.stats.rates()["prefill_tok_s_recent"] or DEFAULT_PREFILL_TOK_S
    return wait + max(0, cold_tokens) / rate


async def estimate_chat(request: Request, body: ChatCompletionRequest) -> dict[str, Any]:
    """The estimate of a chat-completions body (``/v1/estimate`` and ``dry_run``).

    Renders the prompt exactly as ``/v1/chat/completions`` does, so ``prompt_tokens``
    equals the ``usage.prompt_tokens`` the same body gets when generated. Raises the
    addressing errors the chat route raises (unknown model or profile).
    """
    registry: Registry = request.app.state.registry
    target = registry.address(body.model, body.profile)
    # The body is checked as the chat route checks it, resident model or not.
    tools, _ = apply_tool_choice(body.tools, body.tool_choice)
    messages = translate.chat_messages(body.messages)
    if not registry.resident(target.spec.id):
        null = dict.fromkeys(
            (
                "prompt_tokens",
                "warm_tokens",
                "cache_tier",
                "need_bytes",
                "free_bytes",
                "drained_bytes",
                "fits_now",
                "fits_drained",
                "context_ok",
                "est_ttft_s",
            )
        )
        return {
            "object": "estimate",
            "model": body.model or target.spec.id,
            "resident": False,
            **null,
            "max_tokens": body.output_cap,
            "context_limit": target.spec.max_kv_size,
        }
    rendered = await generation.render(request, body, messages=messages, tools=tools)
    return estimate(registry, rendered, body.output_cap)


def preflight(request: Request, rendered: Rendered, max_tokens: int | None) -> None:
    """Refuse, before submitting, a request that cannot fit in memory even once the
    running requests finish: a 400 whose message starts ``prompt is too long`` and
    carries the estimated need and the available budget.

    ``max_tokens`` is the cap the body pins (None: unpinned). Does nothing with
    ``GMLX_PREFLIGHT_MEM=0``, or when the model's geometry or free memory is unknown.
    """
    if not request.app.state.settings.server.preflight_mem:
        return
    registry: Registry = request.app.state.registry
    worker = rendered.worker
    geom = registry.geometry(worker.loaded.id)
    free = registry.free_bytes()
    if geom is None or free is None:
        return
    n = len(rendered.ids)
    budget = free + registry.running_kv_bytes()

    def need_bytes(warm: int) -> int:
        return capacity.request_need(
            geom, n, max_tokens=max_tokens, chunk=worker.prefill_step_size, warm_tokens=warm
        ).need_bytes

    need = need_bytes(0)
    if need > budget:  # too big as a miss: a cached prefix may still make it fit
        need = need_bytes(worker.prompt_cache.peek(list(rendered.ids))[1])
    if need > budget:
        output = f" + {max_tokens} max_tokens" if max_tokens else ""
        raise PromptTooLongError(
            f"prompt is too long for the memory available: {n} prompt tokens{output} need an "
            f"estimated {capacity.human(need)} ({need} bytes), but the available budget is "
            f"{capacity.human(budget)} ({budget} bytes).",
            param="messages",
        )


# -- routes -----------------------------------------------------------------------


@router.post("/v1/estimate")
async def estimate_route(body: ChatBody, request: Request) -> dict[str, Any]:
    """A dry-run admission check of a chat-completions body; never loads a model."""
    return await estimate_chat(request, body)


@router.get("/v1/capacity/plan")
async def capacity_plan(
    request: Request,
    width: int = Query(ge=1, description="Streams to run together."),
    depth: int = Query(ge=1, description="Tokens each stream reaches."),
    model: str | None = Query(None, description="The model (default: the table's)."),
) -> dict[str, Any]:
    """Whether ``width`` streams of ``depth`` tokens fit (``ok``) and may start now
    (``admit_now``); ``reason`` names the first failing condition.

    ``ok`` reads the boot table at the smallest tabulated width >= ``width``; it is
    null without a table or under ``GMLX_OVERCOMMIT=1``, and then ``admit_now``
    judges only the timing. Under a yellow band only one free slot is counted.
    """
    registry: Registry = request.app.state.registry
    table = registry.table_for_requests()
    ok: bool | None = None
    detail: str | None = None
    table_width = max_ctx = None
    if table is not None:
        ok, detail = capacity.plan(table, width, depth)
        max_ctx = table.max_ctx_at(width)
        table_width = min((w for w in table.max_ctx if w >= width), default=None)

    gov = registry.governor
    gov.update()
    band = gov.band if gov.enabled else None
    worker = _plan_worker(registry, model)
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
    return {
        "width": width,
        "depth": depth,
        "model": worker.loaded.id if worker else registry.capacity_model,
        "ok": ok,
        "admit_now": reason is None,
        "reason": reason,
        "detail": detail if reason else None,
        "table_width": table_width,
        "max_ctx": max_ctx,
        "band": band.value if band else None,
        "waiting": waiting,
        "in_flight": worker.in_flight if worker else 0,
        "decode_batch": worker.decode_batch if worker else None,
        "free_slots": free,
        "counted_slots": counted,
    }


def _plan_worker(registry: Registry, model: str | None) -> ModelWorker | None:
    """The engine a plan is judged on: the named model, else the table's, else the
    default (or sole) model; None when it is not resident."""
    if model:
        return registry.resident_worker(registry.address(model).spec.id)
    if registry.capacity_model is not None:
        return registry.resident_worker(registry.capacity_model)
    try:
        return registry.resident_worker(registry.address("").spec.id)
    except InvalidRequestError:  # several models and no default: take the only resident one
        workers = registry.workers()
        return workers[0] if len(workers) == 1 else None
