"""A request that fails in the worker, as each protocol's client sees it: a whole answer
is a typed 500 (``engine_error``, the request's id in the message), a stream that has
begun ends with its protocol's error event (``response.failed`` on the Responses API),
never with a normal finish; and the server answers the next request as usual.

The failure is the worker's own: a logits processor that raises at a chosen decode step
(as in tests/engine/test_isolation.py), given to every request that asks for exactly
``BROKEN`` tokens.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import anthropic
import httpx
import openai
import pytest

from gmlx.engine.requests import ActiveRequest

BROKEN = 13  # requests for exactly this many tokens fail in the worker
USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture
def broken(monkeypatch):
    """Requests for ``BROKEN`` tokens get a logits processor raising at its ``at``-th
    call (set ``broken.at``; 1 fails before any text, 4 after three tokens)."""

    class Breaker:
        at = 1

    real = ActiveRequest.prepare.__func__

    def prepare(cls, handle, tokenizer, **kwargs):
        active = real(cls, handle, tokenizer, **kwargs)
        if handle.request.max_tokens == BROKEN:
            calls = 0

            def processor(tokens, logits):
                nonlocal calls
                calls += 1
                if calls >= Breaker.at:
                    raise ValueError(f"processor broke at call {calls}")
                return logits

            active.processors.append(processor)
        return active

    monkeypatch.setattr(ActiveRequest, "prepare", classmethod(prepare))
    return Breaker


def still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "demo", "messages": USER, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def sse_data(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_a_whole_chat_answer_is_a_typed_500(http, openai_client, broken):
    r = http.post("/v1/chat/completions", json={"model": "demo", "messages": USER, "max_tokens": BROKEN})
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "engine_error" and error["param"] is None
    assert re.fullmatch(r"Request req-\w+ failed: processor broke at call 1\.", error["message"])
    with pytest.raises(openai.InternalServerError) as info:  # what an SDK user gets
        openai_client.chat.completions.create(model="demo", messages=USER, max_tokens=BROKEN)
    assert info.value.status_code == 500 and info.value.code == "engine_error"
    still_serves(http)


def test_the_message_in_a_500_names_the_request(http, broken, caplog):
    """The id a client can quote is in the message and in the server's error log."""
    with caplog.at_level(logging.ERROR):
        r = http.post("/v1/completions", json={"model": "demo", "prompt": "Once", "max_tokens": BROKEN})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    request_id = re.match(r"Request (req-\w+) failed", r.json()["error"]["message"]).group(1)
    assert request_id in "\n".join(rec.getMessage() for rec in caplog.records)


def test_a_whole_anthropic_answer_is_a_typed_500(http, anthropic_client, broken):
    r = http.post("/v1/messages", json={"model": "demo", "messages": USER, "max_tokens": BROKEN})
    assert r.status_code == 500
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "processor broke" in body["error"]["message"]
    with pytest.raises(anthropic.InternalServerError) as info:
        anthropic_client.messages.create(model="demo", messages=USER, max_tokens=BROKEN)
    assert info.value.status_code == 500
    still_serves(http)


def test_a_completions_stream_ends_with_an_error_event_then_done(http, broken):
    broken.at = 4
    with http.stream("POST", "/v1/completions", json={
            "model": "demo", "prompt": "Once upon a time", "max_tokens": BROKEN, "stream": True,
            "temperature": 0}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events = sse_data(lines)
    texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert "".join(texts)  # the tokens before the failure reached the client
    assert all(e["choices"][0]["finish_reason"] is None for e in events if e.get("choices"))
    error = events[-1]["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "processor broke at call 4" in error["message"]
    assert lines[-1] == "data: [DONE]"
    still_serves(http)


def test_a_chat_stream_ends_with_an_error_event_then_done(openai_client, http, broken):
    broken.at = 4
    stream = openai_client.chat.completions.create(
        model="demo", messages=USER, max_tokens=BROKEN, stream=True, temperature=0)
    texts = []
    with pytest.raises(openai.APIError) as info:  # the SDK raises the error event
        for chunk in stream:
            if chunk.choices:
                assert chunk.choices[0].finish_reason is None
                texts.append(chunk.choices[0].delta.content or "")
    assert "".join(texts) and "processor broke" in info.value.message
    still_serves(http)


def test_a_responses_stream_ends_with_response_failed(openai_client, http, broken):
    broken.at = 4
    events = list(openai_client.responses.create(
        model="demo", input="Tell me a story.", max_output_tokens=BROKEN, stream=True, temperature=0))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds  # text went out before the failure
    assert kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds and "response.incomplete" not in kinds
    error_event, failed = events[-2], events[-1].response
    assert error_event.code == "engine_error" and "processor broke at call 4" in error_event.message
    assert failed.status == "failed" and failed.error.code == "engine_error"
    assert failed.id == events[0].response.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    still_serves(http)


def test_a_whole_responses_answer_is_a_typed_500(openai_client, http, broken):
    with pytest.raises(openai.InternalServerError) as info:
        openai_client.responses.create(model="demo", input="Tell me a story.", max_output_tokens=BROKEN)
    assert info.value.status_code == 500 and info.value.code == "engine_error"
    still_serves(http)


def test_an_anthropic_stream_ends_with_an_error_event(http, broken):
    broken.at = 4
    with http.stream("POST", "/v1/messages", json={
            "model": "demo", "messages": USER, "max_tokens": BROKEN, "stream": True}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert "content_block_delta" in text  # text went out before the failure
    assert text.rstrip().split("\n\n")[-1].startswith("event: error\n")
    error = json.loads(text.rstrip().split("\n\n")[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "api_error", "message": error["error"]["message"]}}
    assert "processor broke at call 4" in error["error"]["message"]
    assert "message_stop" not in text and '"stop_reason":"end_turn"' not in text
    still_serves(http)


# -- refusals before any generation ------------------------------------------------------

@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """One decoding slot and no queue: a second request while one runs is refused."""
    from live_server import serve_config

    live = serve_config(tmp_path_factory.mktemp("one-slot"),
                        "server:\n  decode_batch: 1\n  queue_depth_cap: 0\n  warmup: false\n")
    yield live
    live.stop()


def test_a_full_queue_is_an_anthropic_overloaded_error(one_slot):
    worker = one_slot.app.state.registry.worker("demo")
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    sdk = anthropic.Anthropic(base_url=one_slot.url, api_key="x", timeout=30, max_retries=0)
    running: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: running.append(httpx.post(
        f"{one_slot.url}/v1/chat/completions", timeout=60, json={
            "model": "demo", "messages": USER, "max_tokens": 3000, "temperature": 0, "logit_bias": no_eos})))
    holder.start()
    try:
        deadline = time.monotonic() + 30  # poll the worker's rows until it holds the slot
        while not any(r["generated"] > 0 for r in worker.rows()):
            assert time.monotonic() < deadline and holder.is_alive(), "the first request never decoded"
            time.sleep(0.01)
        with httpx.Client(base_url=one_slot.url, timeout=30) as http:
            r = http.post("/v1/messages", json={"model": "demo", "messages": USER, "max_tokens": 4})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
            assert "queue is full" in r.json()["error"]["message"]
            with pytest.raises(anthropic.InternalServerError) as info:  # what an SDK user gets
                sdk.messages.create(model="demo", messages=USER, max_tokens=4)
            assert info.value.status_code == 503 and info.value.body["error"]["type"] == "overloaded_error"
            streamed = http.post("/v1/messages", json={"model": "demo", "messages": USER, "max_tokens": 4,
                                                       "stream": True})
            assert streamed.status_code == 503 and streamed.json()["error"]["type"] == "overloaded_error"
            responses = http.post("/v1/responses", json={"model": "demo", "input": "hi", "max_output_tokens": 4})
            assert responses.status_code == 503 and responses.json()["error"]["code"] == "server_overloaded"
    finally:
        for row in worker.rows():
            worker.cancel(row["id"])
        holder.join(60)
    assert running[0].status_code == 200 and worker.stats.rejections >= 4


# A template that refuses a conversation not alternating user/assistant (as Mistral's,
# Llama 2's and Gemma's do).
ALTERNATING = (
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def alternating(tmp_path_factory, demo_model):
    from live_server import serve_with_template

    live, _ = serve_with_template(tmp_path_factory.mktemp("alternating"), demo_model.source, "alt",
                                  ALTERNATING)
    yield live
    live.stop()


def test_a_template_that_cannot_render_the_messages_is_a_400_on_messages(alternating):
    twice = [{"role": "user", "content": "Hello."}, {"role": "user", "content": "Hello again."}]
    with httpx.Client(base_url=alternating.url, timeout=30) as http:
        fine = http.post("/v1/chat/completions", json={"model": "alt", "messages": twice[:1], "max_tokens": 2})
        assert fine.status_code == 200
        chat = http.post("/v1/chat/completions", json={"model": "alt", "messages": twice, "max_tokens": 2})
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert "cannot render" in error["message"] and "must alternate" in error["message"]
        stream = http.post("/v1/chat/completions", json={
            "model": "alt", "messages": twice, "max_tokens": 2, "stream": True})
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "messages"
        message = http.post("/v1/messages", json={"model": "alt", "messages": twice, "max_tokens": 2})
        assert message.status_code == 400
        assert message.json()["type"] == "error"
        assert message.json()["error"]["type"] == "invalid_request_error"
        assert "must alternate" in message.json()["error"]["message"]
        counted = http.post("/v1/messages/count_tokens", json={"model": "alt", "messages": twice})
        assert counted.status_code == 400 and counted.json()["error"]["type"] == "invalid_request_error"
