"""A server warms its HTTP side before it reports ready: every route is matched once (the
route tables FastAPI builds on the first request that walks them are built at start),
with nothing of it reaching the engine, the access log or the metrics."""

from __future__ import annotations

import logging

import httpx
from fastapi.routing import APIRoute
from live_server import serve_config

from gmlx.server.admin import health
from gmlx.server.app import PROTECTED_ROUTERS, WARM_UP_PATH


def test_every_route_is_walked_before_the_first_request(tmp_path, monkeypatch, caplog):
    walked: set[str] = set()
    original = APIRoute.matches

    def matches(self, scope):
        if scope.get("path") == WARM_UP_PATH:
            walked.add(self.path)
        return original(self, scope)

    monkeypatch.setattr(APIRoute, "matches", matches)
    caplog.set_level(logging.INFO)
    live = serve_config(tmp_path, "server:\n  prompt_cache_bytes: 0\n")
    try:
        routes = {r.path for router in (health.router, *PROTECTED_ROUTERS) for r in router.routes
                  if isinstance(r, APIRoute)}
        assert {"/v1/chat/completions", "/v1/messages", "/v1/responses", "/health"} <= routes
        assert walked == routes  # all of them, at start: no client has sent anything yet
        server = httpx.get(f"{live.url}/v1/metrics", timeout=10).json()["server"]
        assert server["requests"] == [] and server["counters"]["finished"] == 0
        assert server["counters"]["errors"] == 0
        assert not [r for r in caplog.records if WARM_UP_PATH in r.getMessage()]
    finally:
        live.stop()
