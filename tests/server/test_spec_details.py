"""Details of spec/http-api.md that a client written from the spec alone relies on."""

from __future__ import annotations

import pytest
from live_server import serve_config
from prometheus_client.parser import text_string_to_metric_families

from gmlx.config import NOT_SUPPORTED, load_settings
from gmlx.engine import metrics
from gmlx.engine.errors import ConfigError, ServerOverloadedError
from gmlx.engine.governor import ShedError
from gmlx.engine.types import GenerateRequest, SamplingParams


def test_queue_eta_s_is_what_retry_after_carries(demo_model):
    """One slot, one waiting: the refused request's Retry-After and queue.eta_s agree,
    both clamped to the spec's 2..60 s."""
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=1, queue_cap=1)
    tokens = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "eta"}]))
    greedy = SamplingParams(temperature=0)
    try:
        running = worker.submit(GenerateRequest(tokens, max_tokens=5000, sampling=greedy))
        events = iter(running)
        next(events)  # it holds the one slot
        waiting = worker.submit(GenerateRequest(tokens, max_tokens=5000, sampling=greedy))
        with pytest.raises(ServerOverloadedError) as refused:
            worker.submit(GenerateRequest(tokens, max_tokens=3, sampling=greedy))
        retry_after = int(refused.value.headers["Retry-After"])
        eta = metrics.snapshot([worker], started_at=0)["server"]["queue"]["eta_s"]
        assert eta == retry_after and 2 <= eta <= 60
        waiting.cancel()
        running.cancel()
        list(events)
        list(waiting)
        assert metrics.snapshot([worker], started_at=0)["server"]["queue"]["eta_s"] == 0
    finally:
        worker.close()


HEADROOM = 123_456_789_000


@pytest.mark.parametrize("governor", ["true", "false"])
def test_memory_headroom_is_the_governors_measure(tmp_path, governor):
    """memory.headroom_bytes is what the governor's probe measures (scripted here), not
    host RAM, with the governor on or off."""
    live = serve_config(tmp_path, f"server:\n  governor: {governor}\n", probe=lambda: HEADROOM)
    try:
        import httpx

        snap = httpx.get(f"{live.url}/v1/metrics", timeout=30).json()["server"]
        assert snap["memory"]["headroom_bytes"] == HEADROOM
        if governor == "true":
            assert snap["governor"]["headroom_bytes"] == HEADROOM
    finally:
        live.stop()


@pytest.mark.parametrize("prompt", [["Hi"], ["Hi", "there"], [1, 2], [[1, 2]], []])
def test_every_list_prompt_on_completions_is_a_400(http, prompt):
    r = http.post("/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_anthropic_shed_type_is_named_like_the_other_anthropic_errors():
    assert ShedError.anthropic_type == ServerOverloadedError.anthropic_type == "overloaded_error"
    assert ShedError.openai_type == "server_overloaded_shed"  # the spec's name, OpenAI side


def test_the_profile_label_only_where_the_model_has_a_profile():
    snap = {"server": {"resident_models": [
        {"id": "a", "profile": "coding", "in_flight": 1},
        {"id": "b", "profile": None, "in_flight": 0},
    ]}}
    text = metrics.render_prometheus(snap).decode()
    family = {f.name: f for f in text_string_to_metric_families(text)}["gmlx_model_in_flight"]
    labels = {s.labels["model"]: s.labels for s in family.samples}
    assert labels == {"a": {"model": "a", "profile": "coding"}, "b": {"model": "b"}}


def test_the_profile_label_through_the_server(http):
    for model in ("demo", "tiny"):  # demo has profile chat, tiny none
        r = http.post("/v1/chat/completions", json={"model": model, "messages": [
            {"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert r.status_code == 200
    text = http.get("/v1/metrics", params={"format": "prometheus"}).text
    family = {f.name: f for f in text_string_to_metric_families(text)}["gmlx_model_in_flight"]
    by_model = {s.labels["model"]: s.labels for s in family.samples}
    assert by_model["demo"] == {"model": "demo", "profile": "chat"}
    assert by_model["tiny"] == {"model": "tiny"}


@pytest.mark.parametrize("key", NOT_SUPPORTED)
def test_spec_keys_not_supported_yet_fail_saying_so(tmp_path, key):
    section, _, sub = key.rpartition(".")
    text = f"{section}:\n  {sub}: true\n" if section else f"{sub}:\n  model: some-model\n"
    path = tmp_path / "gmlx.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert "not supported yet" in str(err.value) and key in str(err.value)


def test_a_truly_unknown_key_is_still_unknown(tmp_path):
    path = tmp_path / "gmlx.yaml"
    path.write_text("server:\n  no_such_key: 1\n")
    with pytest.raises(ConfigError, match="server.no_such_key: unknown key"):
        load_settings(path)
    path.write_text("stt_typo:\n  model: x\n")
    with pytest.raises(ConfigError, match="stt_typo: unknown key"):
        load_settings(path)
