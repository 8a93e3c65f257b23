"""``POST /v1/estimate`` and ``GET /v1/capacity/plan``: the engine's admission answers
(:mod:`gmlx.engine.admission`), serialised. Neither loads a model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request

from gmlx.engine import admission
from gmlx.engine.errors import InvalidRequestError
from gmlx.server.openai import translate
from gmlx.server.openai.schemas import ChatBody, ChatCompletionRequest
from gmlx.server.schemas import documented

if TYPE_CHECKING:
    from gmlx.engine.chat import Engine
    from gmlx.engine.residency import Registry
    from gmlx.engine.worker import ModelWorker

router = APIRouter()


@router.post("/v1/estimate", openapi_extra=documented(ChatCompletionRequest))
async def estimate_route(body: ChatBody, request: Request) -> dict[str, Any]:
    """A dry-run admission check of a chat-completions body; never loads a model."""
    engine: Engine = request.app.state.engine
    return (await engine.estimate(translate.chat_request(body))).as_dict()


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
    return admission.plan(registry, width, depth, _plan_worker(registry, model)).as_dict()


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
