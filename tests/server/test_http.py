"""Raw HTTP checks: error bodies, /health, SSE framing, auth, warnings, cancellation."""

from __future__ import annotations

import logging
import os
import time

import httpx
import pytest

HI = [{"role": "user", "content": "Say hello."}]


def chat(http: httpx.Client, **body):
    return http.post("/v1/chat/completions", json={"messages": HI, **body})


def test_health_is_exact(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "healthy", "pid": os.getpid()}
    ready = http.get("/health", params={"ready": 1})
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_sse_framing(http):
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "demo", "messages": HI, "max_tokens": 3, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("req-")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: {") for f in frames[:-2])


def test_body_without_json_content_type(http):
    r = http.post(
        "/v1/chat/completions",
        content='{"model": "demo", "messages": '
        '[{"role": "user", "content": "hi"}], "max_tokens": 2}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200, r.text


def test_unknown_model_404(http):
    r = chat(http, model="nope", max_tokens=2)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "model_not_found" and err["available_models"] == ["demo", "tiny"]
    assert set(err) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body", [{"model": "demo", "profile": "nope"}, {"model": "demo@coding", "profile": "nope"}]
)
def test_unknown_profile_400(http, body):
    r = chat(http, max_tokens=2, **body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "unknown_profile" and "coding" in err["valid_profiles"]
    assert "qwen-coder" in err["message"]


def test_empty_model_uses_the_default(http):
    r = chat(http, model="", max_tokens=2)
    assert r.status_code == 200 and r.json()["model"] == "demo"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_is_400_before_streaming(http, stream):
    r = chat(http, model="tiny", max_tokens=60, stream=stream)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("prompt is too long")
    assert "60 max_tokens" in message and "64 tokens" in message
    anth = http.post(
        "/v1/messages", json={"model": "tiny", "max_tokens": 60, "messages": HI, "stream": stream}
    )
    assert anth.status_code == 400
    assert anth.json()["error"]["message"].startswith("prompt is too long")


def test_validation_errors_are_400_in_the_route_shape(http):
    r = http.post("/v1/chat/completions", json={"model": "demo"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/messages", json={"model": "demo", "messages": "no"})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/chat/completions", content="{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = chat(http, model="demo", max_tokens=2, temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = chat(http, model="demo", max_tokens=2, logit_bias={"abc": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_ignored_parameters_warn_once(http, caplog):
    with caplog.at_level(logging.WARNING, logger="gmlx.server"):
        r = chat(
            http,
            model="demo",
            max_tokens=2,
            n=1,
            user="u1",
            metadata={"a": 1},
            frobnicate=True,
            top_logprobs=None,
        )
        assert r.status_code == 200
        anth = http.post(
            "/v1/messages",
            json={
                "model": "demo",
                "max_tokens": 2,
                "messages": HI,
                "stop": ["x"],
                "metadata": {"user_id": "u"},
            },
        )
        assert anth.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if "ignored parameters" in rec.getMessage()]
    assert lines == [
        "/v1/chat/completions: ignored parameters: frobnicate, metadata, n, user",
        "/v1/messages: ignored parameters: metadata, stop",
    ]


def no_eos(worker) -> dict[str, float]:
    """A logit bias that keeps the demo model from ending early."""
    return {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}


def test_disconnect_cancels_the_engine_request(server):
    worker = server.app.state.registry.worker("demo")
    body = {
        "model": "demo",
        "messages": HI,
        "max_tokens": 8000,
        "stream": True,
        "logit_bias": no_eos(worker),
    }
    with (
        httpx.Client(base_url=server.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        # The role chunk can come before the request has its slot: wait for text.
        lines = r.iter_lines()  # kept referenced: closing it would end the response
        for line in lines:
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                break
        assert worker.in_flight == 1
    deadline = time.monotonic() + 10
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.in_flight == 0


def test_unknown_route_is_a_protocol_error(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


class TestApiKey:
    def test_health_needs_no_key(self, key_server):
        assert httpx.get(f"{key_server.url}/health").status_code == 200

    def test_missing_and_wrong_keys_are_401(self, key_server):
        url = f"{key_server.url}/v1/chat/completions"
        body = {"model": "demo", "messages": HI, "max_tokens": 2}
        r = httpx.post(url, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = httpx.post(f"{key_server.url}/v1/messages", json={**body, "messages": HI})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{key_server.url}/v1/models").status_code == 401

    def test_sdks_with_the_key(self, key_server, api_key):
        import anthropic
        import openai

        o = openai.OpenAI(base_url=f"{key_server.url}/v1", api_key=api_key, max_retries=0)
        assert o.chat.completions.create(model="demo", messages=HI, max_tokens=2).choices
        a = anthropic.Anthropic(base_url=key_server.url, api_key=api_key, max_retries=0)
        assert a.messages.create(model="demo", max_tokens=2, messages=HI).content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{key_server.url}/v1", api_key="bad", max_retries=0
            ).models.list()


def test_non_streaming_disconnect_cancels_too(server):
    worker = server.app.state.registry.worker("demo")
    body = {"model": "demo", "messages": HI, "max_tokens": 8000, "logit_bias": no_eos(worker)}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 3  # well before 8000 tokens could finish
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.in_flight == 0


def test_cors_preflight():
    from gmlx.compose import build_app
    from gmlx.config import ServerSettings, Settings

    app = build_app(Settings(server=ServerSettings(cors=["http://ui.test"])))
    transport = httpx.ASGITransport(app=app)

    async def preflight() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.options(
                "/v1/models",
                headers={"Origin": "http://ui.test", "Access-Control-Request-Method": "GET"},
            )

    import asyncio

    r = asyncio.run(preflight())
    assert r.headers["access-control-allow-origin"] == "http://ui.test"
