"""Security: the API key on every route but /health, no keys or prompts in the logs, model
names that cannot reach outside the configured places, CORS only when configured."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from live_server import LiveServer, serve_config

from gmlx.engine.errors import ModelSourceError

OPEN = {"/health"}


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in: the
    routes of included routers too (FastAPI keeps those as the router, included)."""

    def walk(entries):
        for route in entries:
            if isinstance(route, APIRoute):
                yield route
            elif (router := getattr(route, "original_router", None)) is not None:
                yield from walk(router.routes)

    found = []
    for route in walk(app.routes):
        path = re.sub(r"\{[^}]+\}", "some-id", route.path)
        found += [(method, path) for method in sorted(route.methods)]
    documented = {(m.upper(), re.sub(r"\{[^}]+\}", "some-id", p))
                  for p, ops in app.openapi()["paths"].items() for m in ops}
    assert documented <= set(found)  # the walk misses nothing the schema knows
    return found


def test_every_route_but_health_needs_the_key(key_server, api_key):
    served = routes(key_server.app)
    assert len(served) >= 20 and ("POST", "/v1/chat/completions") in served
    with httpx.Client(base_url=key_server.url, timeout=30) as client:
        for method, path in served:
            if path in OPEN:
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                r = client.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.text)
                body = r.json()
                if path.startswith("/v1/messages"):
                    assert body["error"]["type"] == "authentication_error", (method, path)
                else:
                    assert body["error"]["code"] == "invalid_api_key", (method, path)
        assert client.get("/health").status_code == 200
        ok = client.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"})
        assert ok.status_code == 200
        assert client.get("/v1/models", headers={"x-api-key": api_key}).status_code == 200


PROMPT = "zebra-quartz-7731 secret plan"


def test_keys_and_prompts_never_reach_the_logs(key_server, api_key, caplog):
    """At the default level (INFO) of every logger: generation on each protocol, a
    stream, an ignored field, a bad field and a wrong key."""
    caplog.set_level(logging.INFO)
    auth = {"Authorization": f"Bearer {api_key}"}
    msgs = [{"role": "user", "content": PROMPT}]
    with httpx.Client(base_url=key_server.url, headers=auth, timeout=30) as client:
        calls = [
            ("/v1/chat/completions", {"model": "demo", "messages": msgs, "max_tokens": 3,
                                      "user": PROMPT, "some_field": PROMPT}),
            ("/v1/chat/completions", {"model": "demo", "messages": msgs, "max_tokens": 3, "stream": True}),
            ("/v1/chat/completions", {"model": "demo", "messages": msgs, "temperature": PROMPT}),
            ("/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 3}),
            ("/v1/responses", {"model": "demo", "input": PROMPT, "max_output_tokens": 3}),
            ("/v1/messages", {"model": "demo", "messages": msgs, "max_tokens": 3}),
            ("/v1/messages/count_tokens", {"model": "demo", "messages": msgs}),
            ("/v1/chat/completions", {"model": PROMPT, "messages": msgs}),
        ]
        for path, body in calls:
            assert client.post(path, json=body).status_code in (200, 400, 404)
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {PROMPT}"}).status_code == 401
    logged = caplog.text + "\n".join(str(r.args) for r in caplog.records)
    assert caplog.records, "nothing was logged: the capture is not working"
    assert api_key not in logged
    assert "zebra-quartz" not in logged


BAD_NAMES = [
    "../demo", "../../etc/passwd", "/etc/passwd", "demo/../demo", "..%2F..%2Fetc%2Fpasswd",
    "%2e%2e/%2e%2e/etc/passwd", "~/.ssh/id_rsa", "file:///etc/passwd", "hf:org/repo",
    "hf:../../etc/passwd", "hf:org/repo/../../../etc/passwd", "demo\x00", "C:\\Windows\\win.ini",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_model_names_are_ids_never_paths(http, name):
    """A request's model is looked up among the served ids only: whatever it looks like,
    an unknown one is a 404 naming it, on every route that takes one."""
    hi = [{"role": "user", "content": "Hi"}]
    openai_routes = [
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
        ("/v1/estimate", {"messages": hi}),
        ("/v1/keep", {}),
        ("/unload", {}),
        ("/v1/cache/reset", {}),
    ]
    for path, body in openai_routes:
        r = http.post(path, json={"model": name, **body})
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "model_not_found"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = http.post(path, json={"model": name, "messages": hi, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/capacity/plan", params={"width": 1, "depth": 8, "model": name})
    assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"


def test_models_dir_names_ids_never_paths(tmp_path, demo_files):
    """models_dir serves the entries in it by name: a model inside, and a link the
    operator placed there (linking models into one folder is how people collect them);
    a client's path-like name never reaches the file system."""
    outside = tmp_path / "elsewhere" / "secret-model"
    outside.mkdir(parents=True)
    for name, path in demo_files.items():
        shutil.copyfile(path, outside / name)
    models = tmp_path / "models"
    models.mkdir()
    (models / "linked").symlink_to(outside)
    shutil.copytree(outside, models / "inside")
    live = serve_config(tmp_path, f"server:\n  models_dir: {models}\n", models=())
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert ids == ["inside", "linked"]
            for name in ("../elsewhere/secret-model", str(outside), "secret-model",
                         "inside/../linked", f"{models}/inside"):
                r = client.post("/v1/chat/completions", json={"model": name, "messages": [
                    {"role": "user", "content": "Hi"}], "max_tokens": 2})
                assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
    finally:
        live.stop()


@pytest.mark.parametrize("ref", ["hf:org/repo/../../x.gguf", "hf:org/../etc", "hf:./repo/x",
                                 "hf:org/repo/a/../../../b"])
def test_hf_refs_cannot_climb_out_of_the_cache(hf_cache, demo_files, ref):
    from gmlx.engine.loading import hf_cache as hf

    hf_cache("org/repo", demo_files)
    with pytest.raises(ModelSourceError, match="not a Hugging Face reference"):
        hf.resolve(ref)
    assert hf.resolve("hf:org/repo").is_dir()  # the real ref still resolves


def test_cors_is_off_by_default(http):
    r = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    pre = http.options("/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory) -> LiveServer:
    folder: Path = tmp_path_factory.mktemp("cors")
    live = serve_config(folder, "server:\n  cors: [http://app.example]\n  max_body_bytes: 2048\n")
    yield live
    live.stop()


def test_cors_when_configured(cors_server):
    with httpx.Client(base_url=cors_server.url, timeout=30) as client:
        origin = {"Origin": "http://app.example"}
        assert client.get("/v1/models", headers=origin).headers[
            "access-control-allow-origin"] == "http://app.example"
        pre = client.options("/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://app.example"
        other = client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        # A refusal is readable by the page too.
        big = client.post("/v1/chat/completions", headers=origin, content=b"x" * 4096)
        assert big.status_code == 413
        assert big.headers["access-control-allow-origin"] == "http://app.example"
