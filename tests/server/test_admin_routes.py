"""The operational routes on the shared live server: metrics (JSON and Prometheus),
status, the prompt cache routes and cancelling a request from a second client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Everything sits under ``server``: the process, the spec's sections, and gmlx's
# outcome counters.
SERVER_KEYS = {
    "pid",
    "uptime_s",
    "concurrency",
    "queue",
    "requests",
    "resident_models",
    "governor",
    "memory",
    "capacity",
    "rates",
    "counters",
}


@pytest.fixture(scope="module", autouse=True)
def _clean_shared_cache(server) -> Iterator[None]:
    """Leave the shared server's prompt cache as empty as this module found it, so
    other modules' seeded answers do not start from this module's prefixes."""
    yield
    httpx.delete(f"{server.url}/v1/cache", timeout=30).raise_for_status()


def no_eos(worker) -> dict[str, int]:
    """A logit bias that keeps the demo model from ending a long answer early."""
    return {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}


@contextmanager
def long_stream(openai_client: openai.OpenAI, worker, content: str) -> Iterator:
    """A streaming chat request that runs until cancelled; yields (stream, first chunk)
    and closes the stream (a disconnect, which cancels it) on the way out."""
    stream = openai_client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": content}],
        max_tokens=8000,
        stream=True,
        logit_bias=no_eos(worker),
    )
    try:
        first = next(iter(stream))  # the role chunk comes before the request has a slot
        engine_id = "req-" + first.id.removeprefix("chatcmpl-")
        deadline = time.monotonic() + 10
        while engine_id not in {r["id"] for r in worker.rows() if r["state"] != "queued"}:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        yield stream, first
    finally:
        stream.close()
        deadline = time.monotonic() + 10
        while worker.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)


def test_metrics_sections_and_a_live_request_row(server, http, openai_client):
    worker = server.app.state.registry.worker("demo")
    with long_stream(openai_client, worker, "Count forever.") as (_, first):
        engine_id = "req-" + first.id.removeprefix("chatcmpl-")
        snap = http.get("/v1/metrics").json()
        assert set(snap) == {"server"}
        live = snap["server"]
        assert set(live) == SERVER_KEYS and live["pid"] > 0
        (row,) = [r for r in live["requests"] if r["id"] == engine_id]
        assert row["model"] == "demo" and row["state"] in ("prefill", "decode")
        assert row["max_tokens"] == 8000 and row["prompt_tokens"] > 0
        assert live["concurrency"]["in_flight"] >= 1
        assert live["concurrency"]["decode_batch"] == 4
        assert live["concurrency"]["queue_cap"] == 16  # 4 x the decode width
        (model,) = [m for m in live["resident_models"] if m["id"] == "demo"]
        assert model["in_flight"] >= 1 and model["pinned"] is False and model["profile"] == "chat"
        assert live["governor"]["enabled"] is True and live["governor"]["band"] == "green"
        cap = live["capacity"]
        assert cap["model"] == "demo" and cap["max_ctx"]["1"] == 8192
        assert live["memory"]["active_bytes"] > 0
        assert set(live["queue"]) >= {"waiting", "cap", "eta_s", "rejections"}
        assert set(live["rates"]) >= {"decode_tok_s", "decode_streams"}
    assert http.get("/metrics").json()["server"]["concurrency"]["in_flight"] == 0


def test_prometheus_text_parses(http):
    r = http.get("/v1/metrics", params={"format": "prometheus"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "gmlx_concurrency_in_flight",
        "gmlx_queue_eta_s",
        "gmlx_governor_band",
        "gmlx_capacity_max_ctx",
        "gmlx_requests",
    ):
        assert name in families, name
    bands = {s.labels["band"]: s.value for s in families["gmlx_governor_band"].samples}
    assert bands == {"green": 1.0, "yellow": 0.0, "orange": 0.0, "red": 0.0}
    widths = {s.labels["width"] for s in families["gmlx_capacity_max_ctx"].samples}
    assert {"1", "8"} <= widths
    per_model = families["gmlx_model_in_flight"].samples
    assert any(s.labels["model"] == "demo" and s.labels["profile"] == "chat" for s in per_model)
    assert http.get("/metrics", params={"format": "xml"}).status_code == 400


def test_status(server, http):
    body = http.get("/v1/status").json()
    assert body["server"]["pid"] > 0 and body["server"]["port"] == int(server.url.rsplit(":", 1)[1])
    assert body["server"]["version"]
    demo = next(m for m in body["models"] if m["id"] == "demo")
    assert demo["resident"] and demo["decode_batch"] == 4 and demo["in_flight"] == 0
    assert body["engine"]["backend"] == "cpu" and body["engine"]["capacity_model"] == "demo"
    assert body["governor"]["band"] == "green"


def test_models_report_memory_context_for_the_table_model_only(http):
    rows = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert rows["demo"]["max_context_at_width_1"] == 8192
    assert rows["tiny"]["max_context_at_width_1"] is None


def chat(http: httpx.Client, messages: list[dict[str, str]]) -> dict:
    r = http.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": messages, "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def estimate(http: httpx.Client, messages: list[dict[str, str]]) -> dict:
    r = http.post("/v1/estimate", json={"model": "demo", "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def test_cache_stats_hit_reset_and_deletes(http):
    convo = [{"role": "user", "content": "Tell me about caches, please."}]
    before = http.get("/v1/cache/stats").json()
    assert before["enabled"] is True and "demo" in before["models"]
    first = chat(http, convo)
    again = estimate(http, convo)
    assert again["cache_tier"] == "exact" and again["warm_tokens"] == again["prompt_tokens"] - 1
    chat(http, convo)
    longer = convo + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And then?"},
    ]
    follow = estimate(http, longer)
    assert follow["cache_tier"] == "block" and 0 < follow["warm_tokens"] < follow["prompt_tokens"]

    after = http.get("/v1/cache/stats").json()
    demo, was = after["models"]["demo"], before["models"]["demo"]
    # The first request may already reuse the template's opening (a block hit).
    assert demo["tiers"]["exact"] == was["tiers"]["exact"] + 1 and demo["hits"] > was["hits"]
    assert demo["tokens_reused"] > was["tokens_reused"] and demo["entries"] >= 1
    assert after["totals"]["hits"] >= demo["hits"] and after["totals"]["tiers"]["exact"] >= 1

    r = http.post("/v1/cache/reset", json={"model": "demo"})
    assert r.status_code == 200 and r.json()["reset"] == ["demo"]
    assert http.get("/v1/cache/stats").json()["models"]["demo"]["entries"] == 0
    assert estimate(http, convo)["cache_tier"] == "miss"
    missing = http.post("/v1/cache/reset", json={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"
    for method, path in (
        ("POST", "/v1/cache/reset"),
        ("DELETE", "/v1/cache"),
        ("DELETE", "/v1/cache/prefix"),
    ):
        chat(http, convo)
        assert http.get("/v1/cache/stats").json()["models"]["demo"]["entries"] >= 1
        assert http.request(method, path).status_code == 200
        assert http.get("/v1/cache/stats").json()["models"]["demo"]["entries"] == 0


def test_cancel_route_ends_a_running_stream(server, openai_client):
    worker = server.app.state.registry.worker("demo")
    with (
        long_stream(openai_client, worker, "Go on and on.") as (stream, first),
        httpx.Client(base_url=server.url, timeout=30) as other,
    ):
        assert worker.in_flight == 1
        r = other.post(f"/v1/requests/{first.id}/cancel")  # the chatcmpl- id the SDK shows
        assert r.status_code == 200, r.text
        assert r.json()["cancelled"] is True and r.json()["id"].startswith("req-")
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        assert finishes[-1] == "cancelled"
        assert other.post(f"/v1/requests/{first.id}/cancel").status_code == 404
    with long_stream(openai_client, worker, "Once more.") as (stream, first):
        engine_id = "req-" + first.id.removeprefix("chatcmpl-")
        r = httpx.delete(f"{server.url}/v1/requests/{engine_id}")
        assert r.status_code == 200 and r.json()["id"] == engine_id
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "cancelled"


def test_unknown_request_is_404(http):
    r = http.post("/v1/requests/req-nope/cancel")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "request_not_found"
    assert http.delete("/v1/requests/nope").status_code == 404


def test_admin_routes_need_the_key(key_server, api_key):
    paths = [
        ("GET", "/v1/metrics"),
        ("GET", "/metrics"),
        ("GET", "/v1/status"),
        ("GET", "/v1/cache/stats"),
        ("DELETE", "/v1/cache"),
        ("GET", "/v1/capacity/plan?width=1&depth=10"),
        ("POST", "/v1/requests/x/cancel"),
    ]
    with httpx.Client(base_url=key_server.url, timeout=30) as c:
        for method, path in paths:
            r = c.request(method, path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": f"Bearer {api_key}"}
        assert c.get("/v1/metrics", headers=auth).status_code == 200
        assert c.get("/v1/status", headers=auth).status_code == 200
