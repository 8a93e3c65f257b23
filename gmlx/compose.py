"""The composition root: settings in, a model registry or a server app out.

:mod:`gmlx.config` knows what the settings say and whether they are valid; this module
is the one place that turns them into running parts (the engine's
:class:`~gmlx.engine.residency.Registry`, the FastAPI app). Front ends (``gmlx serve``,
``gmlx run``, ``gmlx estimate``) and tests call it; nothing here loads a model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from gmlx.config import ModelConfig, Settings, load_settings
from gmlx.engine.drafting import DraftSpec
from gmlx.engine.residency import ModelSpec, Registry

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gmlx.engine.chat import Engine
    from gmlx.engine.reloading import ReloadResult


def model_spec(model_id: str, model: ModelConfig, *, at_start: bool = False,
               models: Mapping[str, ModelConfig] | None = None) -> ModelSpec:
    """The engine's view of one ``models:`` entry. A model loaded at start (``at_start``:
    named on the command line, or ``preload``) stays resident until told otherwise: it
    idles out only when its own entry sets an ``idle_timeout``."""
    idle_timeout = model.idle_timeout
    if idle_timeout is None and (at_start or model.preload):
        idle_timeout = 0.0
    return ModelSpec(
        id=model_id,
        source=model.source,
        max_kv_size=model.max_kv_size,
        kv_quant=model.kv_quant.to_kv_quant() if model.kv_quant is not None else None,
        draft=draft_spec(model, models or {}),
        profile=model.profile,
        default=model.default,
        pinned=model.pinned,
        mmproj=model.mmproj,
        preload=model.preload,
        idle_timeout=idle_timeout,
    )


def draft_spec(model: ModelConfig, models: Mapping[str, ModelConfig]) -> DraftSpec | None:
    """A model's drafting, its ``draft_model`` resolved to a source through ``models``
    (the served models) when it names one (None: it does not draft)."""
    if model.prompt_lookup:
        return DraftSpec(prompt_lookup=True, draft_tokens=model.draft_tokens)
    if model.draft_model is None:
        return None
    named = models.get(model.draft_model)
    return DraftSpec(draft_source=named.source if named is not None else model.draft_model,
                     draft_tokens=model.draft_tokens)


def served_models(settings: Settings) -> dict[str, ModelConfig]:
    """The configured models, then those found in ``server.models_dir`` (GGUF files and
    MLX model folders, by file stem or folder name) that no configured id takes."""
    models = dict(settings.models)
    folder = settings.server.models_dir
    if folder:
        for model_id, source in discover(Path(folder).expanduser()).items():
            models.setdefault(model_id, ModelConfig(source=str(source)))
    return models


def discover(folder: Path) -> dict[str, Path]:
    """Model sources directly inside ``folder``: ``*.gguf`` files (not ``mmproj`` vision
    projectors) and folders holding an MLX model (``config.json`` and safetensors),
    by id. A missing or unreadable folder holds none."""
    found: dict[str, Path] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return found
    for entry in entries:
        if entry.is_file() and entry.suffix == ".gguf" and not entry.name.startswith("mmproj"):
            found[entry.stem] = entry
        elif entry.is_dir() and (entry / "config.json").is_file() and any(entry.glob("*.safetensors")):
            found[entry.name] = entry
    return found


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
        model_specs(settings),
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
        idle_timeout=server.idle_timeout,
    )


def model_specs(settings: Settings) -> list[ModelSpec]:
    """Every served model (configured and discovered) as the engine sees it."""
    at_start = set(settings.preload)
    served = served_models(settings)
    return [model_spec(mid, m, at_start=mid in at_start, models=served) for mid, m in served.items()]


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

    def reload(current: Settings) -> tuple[Settings, ReloadResult] | None:
        return reload_config(current, registry)

    return create_app(settings, engine=build_engine(settings, registry), reload=reload)


def reload_config(current: Settings, registry: Registry) -> tuple[Settings, ReloadResult] | None:
    """Re-read the config file ``current`` came from and re-register its models,
    aliases and profiles (``Registry.reconfigure`` keeps the resident models whose load
    parameters did not change). Models named on the command line stay served, and the
    ``server:`` section stays as the server started (an address cannot change live).
    None when ``current`` came from no file. Raises ConfigError for a bad file, leaving
    everything as it was."""
    if current.source_file is None:
        return None
    fresh = load_settings(current.source_file)
    models = dict(fresh.models)
    for model_id in current.preload:
        models.setdefault(model_id, current.models[model_id])
    fresh = fresh.model_copy(
        update={"models": models, "preload": current.preload, "server": current.server}
    )
    result = registry.reconfigure(model_specs(fresh), fresh.aliases, fresh.profile_book())
    return fresh, result


def build_engine(settings: Settings, registry: Registry, *, top_logprobs_cap: int | None = None) -> Engine:
    """The engine every front end submits through, over ``registry``: the memory
    preflight as ``server.preflight_mem`` says, logprob alternatives capped at
    ``top_logprobs_cap`` (default: ``server.top_logprobs_k``, ``TOP_LOGPROBS_K``), image
    URLs fetched as the ``server.image_*`` settings say."""
    from gmlx.engine.chat import Engine
    from gmlx.engine.media import FetchPolicy

    server = settings.server
    cap = server.top_logprobs_k if top_logprobs_cap is None else top_logprobs_cap
    policy = FetchPolicy(
        remote=server.image_fetch,
        allow_private=server.image_fetch_private,
        max_bytes=server.image_max_bytes,
        timeout_s=server.image_fetch_timeout_s,
    )
    return Engine(registry, preflight_mem=server.preflight_mem, top_logprobs_cap=cap,
                  fetch_policy=policy)
