"""The Responses API as an agent loop uses it, through the official SDK: a forced
``function_call``, its ``function_call_output`` sent back, and the next turn rendered as
the same conversation on Chat Completions; and a Responses request shed by the memory
governor, streamed and whole."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from live_server import GREEN, RED, Headroom, serve_governed

WEATHER = {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}
QUESTION = "Weather in Paris?"
RESULT = "Sunny, 21 C."


def forced_call(openai_client, **kwargs):
    return openai_client.responses.create(
        model="demo", input=QUESTION, tools=[{"type": "function", **WEATHER}],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
        temperature=1.0, extra_body={"seed": 3}, **kwargs)


def test_a_function_call_and_its_output_make_the_next_turn(openai_client):
    first = forced_call(openai_client)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id and call.id and call.call_id != call.id
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 12

    # The agent sends the whole history back: the call as it came, then its output.
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = openai_client.responses.create(
        model="demo", input=history, tools=[{"type": "function", **WEATHER}], max_output_tokens=4,
        temperature=0)
    assert second.status in ("completed", "incomplete")

    # The same turn on Chat Completions: the same prompt, so the same greedy answer.
    chat = openai_client.chat.completions.create(
        model="demo", tools=[{"type": "function", "function": WEATHER}], max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": RESULT}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    answer = chat.choices[0].message
    if answer.tool_calls:
        assert [(c.function.name, c.function.arguments) for c in answer.tool_calls] == [
            (i.name, i.arguments) for i in second.output if i.type == "function_call"]
    else:
        assert second.output_text == (answer.content or "")


def test_a_streamed_function_call_is_the_whole_ones_item(openai_client):
    whole = forced_call(openai_client).output[0]
    events = list(forced_call(openai_client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.function_call_arguments.done") == 1
    done = next(e for e in events if e.type == "response.output_item.done").item
    assert (done.type, done.name, done.arguments) == ("function_call", whole.name, whole.arguments)
    assert [i.call_id for i in events[-1].response.output] == [done.call_id]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == whole.arguments


# -- shedding --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def probe() -> Headroom:
    return Headroom()


@pytest.fixture(scope="module")
def governed(tmp_path_factory, probe):
    live = serve_governed(tmp_path_factory.mktemp("shed-responses"), probe)
    yield live
    live.stop()


def long_body(live) -> dict:
    eos = live.app.state.registry.worker("demo").loaded.tokenizer.eos_token_ids
    return {"model": "demo", "input": "Write a long story.", "max_output_tokens": 3000,
            "temperature": 0, "logit_bias": {str(t): -100 for t in eos}}


def test_a_streamed_response_that_is_shed_fails(governed, probe):
    probe.value = GREEN
    client = openai.OpenAI(base_url=f"{governed.url}/v1", api_key="x", timeout=60, max_retries=0)
    events = []
    try:
        body = long_body(governed)
        extra = {"logit_bias": body.pop("logit_bias")}  # gmlx's, beyond the SDK's fields
        for event in client.responses.create(**body, stream=True, extra_body=extra):
            events.append(event)
            if event.type == "response.output_text.delta":
                probe.value = RED  # the governor sheds the largest running request: this one
    finally:
        probe.value = GREEN
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds[-4:]
    assert "response.completed" not in kinds
    assert events[-2].code == "server_overloaded_shed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_overloaded_shed"
    # What was streamed before the shed is closed as an item, so a client can keep it.
    assert any(e.type == "response.output_item.done" for e in events)


def test_a_whole_response_that_is_shed_is_a_typed_503(governed, probe):
    probe.value = GREEN
    worker = governed.app.state.registry.worker("demo")
    answer: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answer.append(
        httpx.post(f"{governed.url}/v1/responses", json=long_body(governed), timeout=60)))
    thread.start()
    try:
        deadline = time.monotonic() + 30  # poll the worker's rows until the request decodes
        while not any(r["generated"] > 0 for r in worker.rows()):
            assert time.monotonic() < deadline and thread.is_alive(), "the request never decoded"
            time.sleep(0.01)
        probe.value = RED
        thread.join(60)
    finally:
        probe.value = GREEN
    (r,) = answer
    assert r.status_code == 503 and "Retry-After" in r.headers
    error = r.json()["error"]
    assert error["type"] == "server_overloaded_shed" and error["code"] == "server_overloaded_shed"
