"""``create_app(settings, engine=...)``: the FastAPI app over one engine.

All state lives on ``app.state`` (``settings``, ``engine``, its ``registry``,
``started_at`` in epoch seconds, ``started_mono`` on the monotonic clock), so several
apps can live in one process (tests do). Routes translate their protocol into engine
requests and hand them to ``app.state.engine``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from gmlx import __version__
from gmlx.config import Settings
from gmlx.engine import threads
from gmlx.engine.chat import Engine
from gmlx.engine.residency import Registry
from gmlx.server import errors
from gmlx.server.admin import cache, capacity, health, metrics, models, requests, residency, status
from gmlx.server.anthropic import routes as anthropic_routes
from gmlx.server.auth import require_api_key
from gmlx.server.limits import BodyLimit
from gmlx.server.openai import responses as openai_responses
from gmlx.server.openai import routes as openai_routes

log = logging.getLogger("gmlx.server")

# Every route but /health's needs the API key (when one is set).
PROTECTED_ROUTERS = (
    models.router,
    metrics.router,
    status.router,
    capacity.router,
    cache.router,
    requests.router,
    residency.router,
    openai_routes.router,
    openai_responses.router,
    anthropic_routes.router,
)


def create_app(
    settings: Settings,
    *,
    engine: Engine,
    reload: Callable[[Settings], tuple[Settings, Any] | None] | None = None,
) -> FastAPI:
    """The server app over ``engine`` and its registry (built from ``settings`` by
    :mod:`gmlx.compose`, whose ``build_app`` builds all three). It listens at once:
    models in ``settings.startup_models()`` load in the background as it starts (until
    they are in, ``/health?ready=1`` answers ``loading`` and requests for them wait),
    the others on their first request; idle models unload after their timeout.
    ``reload`` re-reads the config for ``POST /v1/reload`` (None: unsupported).
    Stopping the app stops every worker.
    """
    registry = engine.registry

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = settings.server
        startup = settings.startup_models()
        app.state.starting = asyncio.wrap_future(threads.submit(_preload, registry, startup))
        registry.start_reaper()
        await _warm_routes(app)
        served = ", ".join(
            f"{i.id}{f' (alias of {i.alias_of})' if i.alias_of else ''}" for i in registry.listing()
        )
        log.info("serving %s%s", served or "no models",
                 f"; loading {', '.join(startup)}" if startup else "")
        log.info(
            "listening on http://%s:%d (config: %s)", server.host, server.port, settings.origin
        )
        try:
            yield
        finally:
            await threads.run(registry.close)

    app = FastAPI(
        title="gmlx",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,  # every route but /health needs the key; the docs would not
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.started_at = int(time.time())
    app.state.started_mono = time.monotonic()
    app.state.engine = engine
    app.state.reload = reload
    app.state.starting = None  # the startup loads, while the app runs
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.server.max_body_bytes)
    if settings.server.cors:  # outermost, so refusals carry the CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.server.cors,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.include_router(health.router)
    protected = [Depends(require_api_key)]
    for router in PROTECTED_ROUTERS:
        app.include_router(router, dependencies=protected)
    return app


WARM_UP_PATH = "/__gmlx/warm-up"


async def _warm_routes(app: FastAPI) -> None:
    """Do now what FastAPI and anyio do on a server's first requests: FastAPI builds each
    included router's route table (every route's dependency tree and validators) on the
    first request that walks it, and anyio imports its event-loop backend on the first
    task group (every streamed response opens one). Measured with a raw HTTP client on a
    2-core CPU: a first request's time to first token 122 -> 106 ms, steady ~104. One
    request, handed to the app in process, to a path no route has walks every router (a
    404 that reaches no model, no socket and no log), and one empty task group loads the
    backend."""
    import anyio

    async with anyio.create_task_group():
        pass
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": WARM_UP_PATH, "raw_path": WARM_UP_PATH.encode(),
        "query_string": b"", "root_path": "", "headers": [], "client": None,
        "server": ("127.0.0.1", 0),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)


def _preload(registry: Registry, model_ids: Iterable[str]) -> None:
    """Load the startup models one by one; one that fails is logged and stays
    unloaded (its first request tries again and gets the load error)."""
    for model_id in model_ids:
        try:
            registry.worker(model_id)
        except Exception:
            log.exception("cannot load %s at start", model_id)
