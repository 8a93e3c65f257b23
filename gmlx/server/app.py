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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from gmlx import __version__
from gmlx.config import Settings
from gmlx.engine.chat import Engine
from gmlx.server import errors
from gmlx.server.admin import cache, capacity, health, metrics, models, requests, status
from gmlx.server.anthropic import routes as anthropic_routes
from gmlx.server.auth import require_api_key
from gmlx.server.openai import responses as openai_responses
from gmlx.server.openai import routes as openai_routes

log = logging.getLogger("gmlx.server")


def create_app(settings: Settings, *, engine: Engine) -> FastAPI:
    """The server app over ``engine`` and its registry (built from ``settings`` by
    :mod:`gmlx.compose`, whose ``build_app`` builds all three). Models in
    ``settings.startup_models()`` load when it starts; the others on their first
    request. Stopping the app stops every worker.
    """
    registry = engine.registry

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(registry.preload, settings.startup_models())
        server = settings.server
        served = ", ".join(
            f"{i.id}{f' (alias of {i.alias_of})' if i.alias_of else ''}"
            f"{' [resident]' if i.resident else ''}"
            for i in registry.listing()
        )
        log.info("serving %s", served or "no models")
        log.info(
            "listening on http://%s:%d (config: %s)", server.host, server.port, settings.origin
        )
        try:
            yield
        finally:
            await asyncio.to_thread(registry.close)

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
    errors.install(app)
    if settings.server.cors:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.server.cors,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.include_router(health.router)
    protected = [Depends(require_api_key)]
    for router in (
        models.router,
        metrics.router,
        status.router,
        capacity.router,
        cache.router,
        requests.router,
        openai_routes.router,
        openai_responses.router,
        anthropic_routes.router,
    ):
        app.include_router(router, dependencies=protected)
    return app
