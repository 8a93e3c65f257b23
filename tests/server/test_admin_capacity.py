"""Admission on live servers: /v1/estimate and dry runs, /v1/capacity/plan, readiness,
the memory preflight and the queue cap, with the free memory scripted by the test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer

from gmlx.compose import build_app
from gmlx.config import ServerSettings, load_settings

HI = [{"role": "user", "content": "Say hello."}]
GREEN = 10**12
FLOOR = 1000  # bands: green >= 4000, yellow >= 2000, orange >= 1000, red below

CONFIG = """\
models:
  demo: {source: demo, default: true}
  cold: demo
"""


@pytest.fixture(scope="module", autouse=True)
def _clean_shared_cache(server) -> Iterator[None]:
    """Leave the shared server's prompt cache as empty as this module found it, so
    other modules' seeded answers do not start from this module's prefixes."""
    yield
    httpx.delete(f"{server.url}/v1/cache", timeout=30).raise_for_status()


class Headroom:
    """The free working set the server sees, set by the test."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value

    def set(self, value: int) -> None:
        self.value = value
        time.sleep(0.15)  # the governor measures at most every 0.1 s


def start(tmp: Path, env: dict[str, str], probe: Headroom | None = None) -> LiveServer:
    path = tmp / "gmlx.yaml"
    path.write_text(CONFIG)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        settings, _ = load_settings(path).with_models(["demo"])
    return LiveServer.start(build_app(settings, probe=probe))


@pytest.fixture(scope="module")
def headroom() -> Headroom:
    return Headroom(GREEN)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, headroom) -> Iterator[LiveServer]:
    """Decode width 2, queue cap 1, governor floor 1000 bytes, scripted headroom."""
    env = {
        "GMLX_DECODE_BATCH": "2",
        "GMLX_QUEUE_DEPTH_CAP": "1",
        "GMLX_GOVERNOR_FLOOR_BYTES": str(FLOOR),
    }
    live = start(tmp_path_factory.mktemp("scripted"), env, headroom)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def sc(scripted) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=scripted.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="x", timeout=30, max_retries=0)


@contextmanager
def streaming(sdk: openai.OpenAI, worker, n: int) -> Iterator[list]:
    """``n`` endless streams (EOS banned), open until the block ends."""
    bias = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    base = worker.in_flight + worker.waiting
    target = base + n
    with ExitStack() as stack:
        streams = []
        for i in range(n):
            s = sdk.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": f"Stream {i}."}],
                max_tokens=8000,
                stream=True,
                logit_bias=bias,
            )
            stack.callback(s.close)
            next(iter(s))  # the role chunk: the request is submitted
            streams.append(s)
        deadline = time.monotonic() + 10
        while worker.in_flight + worker.waiting < target and time.monotonic() < deadline:
            time.sleep(0.01)  # submitted requests reach the worker's queue asynchronously
        yield streams
    deadline = time.monotonic() + 10
    while worker.in_flight + worker.waiting > base and time.monotonic() < deadline:
        time.sleep(0.02)


def plan(client: httpx.Client, width: int, depth: int = 1000) -> dict:
    r = client.get("/v1/capacity/plan", params={"width": width, "depth": depth})
    assert r.status_code == 200, r.text
    return r.json()


# -- estimate -----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["demo", "coder"])  # coder adds a profile system prompt
def test_estimate_prompt_tokens_equal_usage(http, openai_client, model):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": tools,
        "max_tokens": 3,
    }
    est = http.post("/v1/estimate", json=body).json()
    done = openai_client.chat.completions.create(**body)
    assert est["resident"] is True and est["prompt_tokens"] == done.usage.prompt_tokens
    assert est["need_bytes"] > 0 and est["fits_now"] and est["fits_drained"]
    assert est["context_ok"] and est["context_limit"] == 8192 and est["est_ttft_s"] >= 0
    again = http.post("/v1/chat/completions", json={**body, "dry_run": True}).json()
    assert again["prompt_tokens"] == est["prompt_tokens"] and again["object"] == "estimate"
    assert again["cache_tier"] == "exact" and again["warm_tokens"] == est["prompt_tokens"] - 1
    assert again["need_bytes"] < est["need_bytes"]  # the warm part needs no prefill


def test_estimate_context_limit_and_unpinned_output(http):
    load = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1}
    )
    assert load.status_code == 200  # now resident, so the estimate can count
    est = http.post("/v1/estimate", json={"model": "tiny", "messages": HI, "max_tokens": 60})
    assert est.json()["context_ok"] is False and est.json()["context_limit"] == 64
    free = http.post("/v1/estimate", json={"model": "demo", "messages": HI}).json()
    pinned = http.post(
        "/v1/estimate", json={"model": "demo", "messages": HI, "max_completion_tokens": 4000}
    ).json()
    assert free["max_tokens"] is None and pinned["max_tokens"] == 4000
    assert pinned["need_bytes"] > free["need_bytes"]
    r = http.post("/v1/estimate", json={"model": "nope", "messages": HI})
    assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"


def test_estimate_never_loads_a_model(scripted, sc):
    est = sc.post("/v1/estimate", json={"model": "cold", "messages": HI}).json()
    assert est["resident"] is False and est["prompt_tokens"] is None and est["fits_now"] is None
    dry = sc.post("/v1/chat/completions", json={"model": "cold", "messages": HI, "dry_run": True})
    assert dry.json()["resident"] is False
    # A malformed body is refused for a cold model too, still without loading it.
    bad = sc.post("/v1/estimate", json={"model": "cold", "messages": HI, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    assert not scripted.app.state.registry.resident("cold")


# -- plan, readiness, queue -----------------------------------------------------------


def test_plan_geometry_and_bands(scripted, sc, headroom):
    p = plan(sc, 2)
    assert p["ok"] is True and p["reason"] is None and p["band"] == "green"
    assert p["table_width"] == 2 and p["max_ctx"] == 8192 and p["free_slots"] == 2
    assert plan(sc, 3)["table_width"] == 4  # read at the next tabulated width
    assert plan(sc, 3)["reason"] == "slots"
    deep = plan(sc, 1, depth=10_000)
    assert deep["ok"] is False and deep["reason"] == "geometry" and "8192" in deep["detail"]
    try:
        headroom.set(3 * FLOOR)  # yellow: one free slot counts
        assert plan(sc, 1)["admit_now"] is True
        yellow = plan(sc, 2)
        assert yellow["band"] == "yellow" and yellow["reason"] == "slots"
        assert yellow["counted_slots"] == 1 and yellow["free_slots"] == 2
        assert sc.get("/health", params={"ready": 1}).status_code == 200
        for value in (FLOOR + FLOOR // 2, FLOOR // 2):  # orange, then red
            headroom.set(value)
            p = plan(sc, 1)
            assert p["reason"] == "pressure" and p["ok"] is True and not p["admit_now"]
            r = sc.get("/health", params={"ready": 1})
            assert r.status_code == 503 and r.json()["reason"] == "pressure"
            assert int(r.headers["retry-after"]) > 0
            assert sc.get("/v1/metrics").json()["server"]["governor"]["band"] in ("orange", "red")
    finally:
        headroom.set(GREEN)
    assert plan(sc, 2)["admit_now"] is True
    bad = sc.get("/v1/capacity/plan", params={"width": 0, "depth": 10})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.width"


def test_busy_queue_and_overload(scripted, sc, sdk):
    worker = scripted.app.state.registry.worker("demo")
    with streaming(sdk, worker, 2):
        r = sc.get("/health", params={"ready": 1})
        assert r.status_code == 503 and r.json()["reason"] == "busy"
        assert plan(sc, 1)["reason"] == "slots"
        est = sc.post("/v1/estimate", json={"model": "demo", "messages": HI}).json()
        assert est["drained_bytes"] > est["free_bytes"]  # the running KV comes back
        with streaming(sdk, worker, 1):  # the third waits for a slot
            r = sc.get("/health", params={"ready": 1})
            assert r.status_code == 503 and r.json()["reason"] == "queue"
            assert plan(sc, 1)["reason"] == "queue"
            rows = sc.get("/v1/metrics").json()["server"]["requests"]
            assert rows[0]["state"] == "queued" and rows[0]["position"] == 1
            with pytest.raises(openai.APIStatusError) as caught:
                sdk.chat.completions.create(model="demo", messages=HI, max_tokens=2)
            err = caught.value
            assert err.status_code == 503
            assert err.response.json()["error"]["type"] == "server_overloaded"
            assert 2 <= int(err.response.headers["retry-after"]) <= 60
            queue = sc.get("/v1/metrics").json()["server"]["queue"]
            assert queue["rejections"] >= 1 and queue["cap"] == 1
            # A queued request can be cancelled too.
            sc.post(f"/v1/requests/{rows[0]['id']}/cancel").raise_for_status()
    assert sc.get("/health", params={"ready": 1}).status_code == 200


def test_preflight_refuses_what_cannot_fit(scripted, sc, headroom):
    engine = scripted.app.state.engine  # it read server.preflight_mem at start
    try:
        headroom.set(100_000)  # green against the floor, but smaller than any request
        for stream in (False, True):
            r = sc.post(
                "/v1/chat/completions",
                json={"model": "demo", "messages": HI, "max_tokens": 4, "stream": stream},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["message"].startswith("prompt is too long")
            # The budget: the headroom less the governor's reserve (twice its 1000-byte floor).
            assert "98000 bytes" in err["message"] and err["code"] == "context_length_exceeded"
        est = sc.post("/v1/estimate", json={"model": "demo", "messages": HI}).json()
        assert est["fits_now"] is False and est["fits_drained"] is False
        anth = sc.post("/v1/messages", json={"model": "demo", "max_tokens": 4, "messages": HI})
        assert anth.status_code == 400
        assert anth.json()["error"]["message"].startswith("prompt is too long")
        engine.preflight_mem = False  # what GMLX_PREFLIGHT_MEM=0 sets
        ok = sc.post(
            "/v1/chat/completions", json={"model": "demo", "messages": HI, "max_tokens": 2}
        )
        assert ok.status_code == 200, ok.text
    finally:
        engine.preflight_mem = True
        headroom.set(GREEN)


# -- switches ------------------------------------------------------------------------


def test_switches_from_the_environment(monkeypatch):
    for key, value in {
        "GMLX_PREFLIGHT_MEM": "0",
        "GMLX_GOVERNOR": "0",
        "GMLX_OVERCOMMIT": "1",
        "GMLX_PROMPT_CACHE_BYTES": "0",
        "GMLX_DECODE_BATCH": "3",
    }.items():
        monkeypatch.setenv(key, value)
    s = ServerSettings()
    assert (s.preflight_mem, s.governor, s.overcommit) == (False, False, True)
    assert (s.prompt_cache_bytes, s.decode_batch) == (0, 3)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Iterator[httpx.Client]:
    env = {"GMLX_OVERCOMMIT": "1", "GMLX_PROMPT_CACHE_BYTES": "0", "GMLX_GOVERNOR": "0"}
    live = start(tmp_path_factory.mktemp("plain"), env)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client
    live.stop()


def test_overcommit_cache_off_governor_off(plain):
    assert plain.get("/v1/cache/stats").json() == {"enabled": False}
    rows = {m["id"]: m for m in plain.get("/v1/models").json()["data"]}
    assert rows["demo"]["max_context_at_width_1"] is None
    p = plan(plain, 1, depth=10**6)
    assert p["ok"] is None and p["admit_now"] is True and p["band"] is None
    snap = plain.get("/v1/metrics").json()
    live = snap["server"]
    assert live["governor"]["enabled"] is False and live["capacity"]["model"] == "demo"
    # The decode width comes from the capacity table when nothing sets it.
    assert live["concurrency"]["decode_batch"] >= 1
    body = {"model": "demo", "messages": HI, "max_tokens": 2}
    assert plain.post("/v1/chat/completions", json=body).status_code == 200
    est = plain.post("/v1/estimate", json=body).json()
    assert est["cache_tier"] == "miss" and est["warm_tokens"] == 0
