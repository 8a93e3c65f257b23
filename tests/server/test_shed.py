"""A shed request ends in each protocol's stream shape: finish_reason ``shed`` and an
error of type ``server_overloaded_shed`` (the governor driven by a scripted probe)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from live_server import GREEN, RED, Headroom, LiveServer, serve_governed


@pytest.fixture(scope="module")
def probe() -> Headroom:
    return Headroom()


@pytest.fixture(scope="module")
def governed(tmp_path_factory, probe):
    live = serve_governed(tmp_path_factory.mktemp("shed"), probe)
    yield live
    live.stop()


def has_text(line: str) -> bool:
    """A chat chunk with content, or an Anthropic text delta."""
    return ('"content":"' in line and '"content":""' not in line) or '"text_delta"' in line


def stream_until_shed(live: LiveServer, probe: Headroom, path: str, body: dict) -> list[str]:
    """Start a long stream, turn the headroom red once it produces text, read to the end."""
    probe.value = GREEN
    worker = live.app.state.registry.worker("demo")
    body = {**body, "logit_bias": {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}}
    lines: list[str] = []
    with httpx.Client(base_url=live.url, timeout=60) as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if probe.value == GREEN and has_text(line):
                probe.value = RED
    time.sleep(0.2)
    probe.value = GREEN
    return lines


def payloads(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_openai_stream_ends_shed(governed, probe):
    body = {"model": "demo", "messages": [{"role": "user", "content": "long"}], "max_tokens": 3000,
            "stream": True}
    lines = stream_until_shed(governed, probe, "/v1/chat/completions", body)
    events = payloads(lines)
    finishes = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
    assert finishes[-1] == "shed"
    (error,) = [e["error"] for e in events if "error" in e]
    assert error["type"] == "server_overloaded_shed"
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    assert governed.app.state.registry.governor.sheds >= 1


def test_anthropic_stream_ends_shed(governed, probe):
    body = {"model": "demo", "messages": [{"role": "user", "content": "long"}], "max_tokens": 3000,
            "stream": True}
    events = payloads(stream_until_shed(governed, probe, "/v1/messages", body))
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "shed"
    assert events[-1] == {"type": "error", "error": events[-1]["error"]}
    assert events[-1]["error"]["type"] == "overloaded_error"  # Anthropic's naming


def test_whole_response_is_a_503(governed, probe):
    """Without a stream to carry it, a shed request is answered with the error itself."""
    import threading

    probe.value = GREEN
    worker = governed.app.state.registry.worker("demo")
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}

    def turn_red() -> None:
        deadline = time.monotonic() + 10
        while not any(r["generated"] > 3 for r in worker.rows()) and time.monotonic() < deadline:
            time.sleep(0.01)
        probe.value = RED

    threading.Thread(target=turn_red, daemon=True).start()
    try:
        r = httpx.post(f"{governed.url}/v1/chat/completions", timeout=60, json={
            "model": "demo", "messages": [{"role": "user", "content": "long"}], "max_tokens": 3000,
            "logit_bias": no_eos})
    finally:
        time.sleep(0.2)
        probe.value = GREEN
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "server_overloaded_shed"
    assert "retry-after" in r.headers
