"""Residency through a real server: it listens while its models load, the residency
routes (``/unload``, ``/v1/keep``, ``/v1/reload``), the markers, and discovery."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, serve_config

from gmlx.compose import build_app
from gmlx.config import load_settings
from gmlx.engine import loading

TWO = """\
server: {decode_batch: 2, warmup: false}
models:
  a: demo
  b: demo
"""


def chat(client: httpx.Client, model: str, **fields: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **fields}
    return client.post("/v1/chat/completions", json=body, timeout=60)


def models(client: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


@pytest.fixture
def two(tmp_path: Path, gmlx_home: Path):
    live = serve_config(tmp_path, TWO, models=())
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield live, client
    finally:
        live.stop()


def test_the_server_listens_while_its_model_loads(tmp_path, gmlx_home, monkeypatch):
    """/health answers at once; ready=1 says `loading` with Retry-After; a stream to the
    loading model gets keep-alives, then its answer."""
    release = threading.Event()
    real = loading.load_model

    def slow(source: str, *, model_id: str | None = None, mmproj: str | None = None):
        release.wait(30)
        return real(source, model_id=model_id, mmproj=mmproj)

    monkeypatch.setattr(loading, "load_model", slow)
    (tmp_path / "gmlx.yaml").write_text(TWO)
    settings, _ = load_settings(tmp_path / "gmlx.yaml").with_models(["a"])
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"sse_keepalive_s": 0.05})})
    live = LiveServer.start(build_app(settings), wait_loaded=False)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            assert client.get("/health").json()["status"] == "healthy"
            ready = client.get("/health", params={"ready": 1})
            assert ready.status_code == 503 and ready.json()["reason"] == "loading"
            assert int(ready.headers["Retry-After"]) > 0
            assert models(client)["a"]["resident"] is False  # listing never waits or loads
            threading.Timer(0.5, release.set).start()
            body = {"model": "b", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 3, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line]
            assert lines[0] == ": keep-alive"  # before the model was in
            assert lines[-1] == "data: [DONE]" and any('"finish_reason":"length"' in x for x in lines)
            deadline = time.monotonic() + 30
            while client.get("/health", params={"ready": 1}).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert models(client)["a"]["resident"] is True
    finally:
        release.set()
        live.stop()


def test_keep_unload_and_markers(two):
    _, client = two
    assert models(client)["a"]["resident"] is False
    assert models(client)["a"]["context_length"]  # from the model's files, not loaded
    kept = client.post("/v1/keep", json={"model": "a", "warm": False}).json()
    assert kept["object"] == "keep" and kept["kept"] and kept["resident"] and kept["loaded"]
    a = models(client)["a"]
    assert (a["resident"], a["kept"], a["in_flight"]) == (True, True, 0) and a["weight_bytes"] > 0
    rows = client.get("/v1/metrics").json()["server"]["resident_models"]
    assert [(m["id"], m["kept"]) for m in rows] == [("a", True)]
    released = client.post("/v1/keep", json={"model": "a", "keep": False}).json()
    assert released["kept"] is False and released["resident"] is True
    assert client.post("/unload", json={"model": "a"}).json()["unloaded"] == ["a"]
    assert client.post("/unload", json={"model": "a"}).json()["unloaded"] == []
    assert models(client)["a"]["resident"] is False
    assert chat(client, "b").status_code == 200
    assert client.post("/unload").json()["unloaded"] == ["b"]  # every idle model
    missing = client.post("/unload", json={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"


def test_unload_answers_409_while_the_model_streams(two):
    _, client = two
    body = {"model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400,
            "stream": True, "logit_bias": {"0": -100}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # the stream is decoding
        busy = client.post("/unload", json={"model": "a"})
        assert busy.status_code == 409 and busy.json()["error"]["type"] == "model_busy"
    assert models(client)["a"]["resident"] is True


def test_scrapes_never_load_a_model(two):
    live, client = two
    for path in ("/health", "/v1/models", "/v1/status", "/v1/metrics", "/v1/cache/stats"):
        assert client.get(path).status_code == 200
    assert client.post("/v1/estimate", json={
        "model": "a", "messages": [{"role": "user", "content": "Hi"}]}).json()["resident"] is False
    assert live.app.state.registry.workers() == []
    assert chat(client, "a").status_code == 200
    registry = live.app.state.registry
    used = registry.last_used("a")
    time.sleep(0.05)
    for path in ("/health?ready=1", "/v1/models", "/v1/status", "/v1/metrics"):
        client.get(path)
    estimate = client.post("/v1/estimate", json={
        "model": "a", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert estimate["resident"] is True and estimate["prompt_tokens"] > 0
    assert registry.last_used("a") == used  # none of them reset its idle timer
    assert chat(client, "a").status_code == 200 and registry.last_used("a") > used


def test_reload_adds_and_removes_and_keeps_unchanged(two, tmp_path):
    live, client = two
    assert chat(client, "a").status_code == 200
    worker = live.app.state.registry.resident_worker("a")
    (tmp_path / "gmlx.yaml").write_text(
        "server: {decode_batch: 2, warmup: false}\nmodels:\n  a: demo\n  c: demo\n"
        "aliases:\n  fast: a@precise\n")
    result = client.post("/v1/reload").json()
    assert result["status"] == "ok"
    assert (result["added"], result["removed"], result["unchanged"]) == (["c"], ["b"], ["a"])
    assert live.app.state.registry.resident_worker("a") is worker  # still resident, untouched
    listed = models(client)
    assert "b" not in listed and "c" in listed and listed["fast"]["alias_of"] == "a"
    assert chat(client, "b").status_code == 404
    assert chat(client, "fast").status_code == 200
    (tmp_path / "gmlx.yaml").write_text("models: [not, a, mapping]\n")
    bad = client.post("/v1/reload")
    assert bad.status_code == 400 and "unchanged" in bad.json()["error"]["message"]
    assert "c" in models(client)


def test_reload_without_a_config_file_is_unsupported(gmlx_home):
    settings, _ = load_settings().with_models(["demo"])
    live = LiveServer.start(build_app(settings))
    try:
        r = httpx.post(f"{live.url}/v1/reload", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "unsupported"}
    finally:
        live.stop()


def test_models_dir_models_are_listed_and_addressable(tmp_path, gmlx_home):
    from gmlx.engine.loading import demo

    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "tiny-mlx").symlink_to(demo.ensure_built(), target_is_directory=True)
    (folder / "notes.txt").write_text("not a model")
    live = serve_config(tmp_path, f"server: {{models_dir: {folder}, warmup: false}}\n", models=())
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            assert set(models(client)) == {"tiny-mlx"}
            assert chat(client, "tiny-mlx").status_code == 200
    finally:
        live.stop()
