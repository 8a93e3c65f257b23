"""``hf:`` models in the config serve from the local Hugging Face cache; a request that
names a repo id the config does not is a 404 and loads nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from gmlx.compose import build_app
from gmlx.config import load_settings

HI = [{"role": "user", "content": "hi"}]


def post_all(app: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """The responses of ``app`` to ``(path, body)`` requests, in process, in order."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            return [await c.post(path, json=body) for path, body in requests]

    return asyncio.run(run())


def test_configured_hf_models(hf_cache, demo_files, tmp_path: Path):
    hf_cache("gmlx-test/demo-mlx", demo_files)
    config = tmp_path / "gmlx.yaml"
    config.write_text(
        "models:\n"
        "  qwen: {source: 'hf:gmlx-test/demo-mlx', default: true}\n"
        "  missing: 'hf:gmlx-test/not-downloaded'\n"
    )
    app = build_app(load_settings(config))
    registry = app.state.registry
    try:
        ok, missing, repo_id = post_all(
            app,
            [
                ("/v1/chat/completions", {"model": "qwen", "messages": HI, "max_tokens": 2}),
                ("/v1/chat/completions", {"model": "missing", "messages": HI, "max_tokens": 2}),
                ("/v1/messages", {"model": "Qwen/Qwen2.5-7B", "messages": HI, "max_tokens": 2}),
            ],
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["model"] == "qwen" and registry.resident("qwen")

        assert missing.status_code == 503
        err = missing.json()["error"]
        assert err["code"] == "model_load_error"
        assert "hf:gmlx-test/not-downloaded" in err["message"]
        assert str(hf_cache.root) in err["message"] and "never downloads" in err["message"]

        assert repo_id.status_code == 404
        assert repo_id.json()["error"]["type"] == "not_found_error"
        assert [w.loaded.id for w in registry.workers()] == ["qwen"]
    finally:
        registry.close()
