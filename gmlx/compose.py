"""The composition root: settings in, a model registry or a server app out.

:mod:`gmlx.config` knows what the settings say and whether they are valid; this module
is the one place that turns them into running parts (the engine's
:class:`~gmlx.engine.residency.Registry`, the FastAPI app). Front ends (``gmlx serve``,
``gmlx run``, ``gmlx estimate``) and tests call it; nothing here loads a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gmlx.config import ModelConfig, Settings
from gmlx.engine.residency import ModelSpec, Registry

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gmlx.engine.chat import Engine


def model_spec(model_id: str, model: ModelConfig) -> ModelSpec:
    """The engine's view of one ``models:`` entry."""
    return ModelSpec(
        id=model_id,
        source=model.source,
        max_kv_size=model.max_kv_size,
        profile=model.profile,
        default=model.default,
        pinned=model.pinned,
        mmproj=model.mmproj,
    )


def build_registry(
    settings: Settings,
    decode_batch: int | None = None,
    *,
    probe: Callable[[], int] | None = None,
    warmup: bool | None = None,
) -> Registry:
    """A registry of the configured models (nothing loads until asked), with one
    memory governor shared by all of its workers.

    Args:
        settings: the models, aliases, profiles and ``server`` switches.
        decode_batch: every worker's decode width (default: ``server.decode_batch``,
            else each model's own from its capacity table).
        probe: replaces the free-memory probe (``capacity.free_bytes``) of the governor,
            the capacity table and the preflight; tests script headroom with it.
        warmup: run each model's batch shapes once as it loads (default: ``server.warmup``).
    """
    server = settings.server
    return Registry(
        [model_spec(mid, m) for mid, m in settings.models.items()],
        aliases=settings.aliases,
        profiles=settings.profile_book(),
        decode_batch=decode_batch or server.decode_batch,
        queue_cap=server.queue_depth_cap,
        prompt_cache_bytes=server.prompt_cache_bytes,
        governor=server.governor,
        governor_floor_bytes=server.governor_floor_bytes,
        overcommit=server.overcommit,
        probe=probe,
        warmup=server.warmup if warmup is None else warmup,
    )


def build_app(
    settings: Settings,
    *,
    registry: Registry | None = None,
    probe: Callable[[], int] | None = None,
) -> FastAPI:
    """The server app for ``settings``, over ``registry`` (default: a new one from
    :func:`build_registry`, with ``probe`` as its free-memory probe). Its models load
    when the app starts, or on first use; stopping it stops every worker."""
    from gmlx.server.app import create_app  # FastAPI and the routes: only for a server

    if registry is None:
        registry = build_registry(settings, probe=probe)
    return create_app(settings, engine=build_engine(settings, registry))


def build_engine(settings: Settings, registry: Registry, *, top_logprobs_cap: int | None = None) -> Engine:
    """The engine every front end submits through, over ``registry``: the memory
    preflight as ``server.preflight_mem`` says, logprob alternatives capped at
    ``top_logprobs_cap`` (default: ``server.top_logprobs_k``, ``TOP_LOGPROBS_K``)."""
    from gmlx.engine.chat import Engine

    cap = settings.server.top_logprobs_k if top_logprobs_cap is None else top_logprobs_cap
    return Engine(registry, preflight_mem=settings.server.preflight_mem, top_logprobs_cap=cap)
