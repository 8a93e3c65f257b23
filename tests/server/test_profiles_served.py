"""A profile's system prompt, stop strings and default ``max_tokens``, as a client of each
protocol is served them: the prompt the model reads, where the answer stops and how long
it runs, checked against the model's own greedy answer to the same conversation."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from live_server import serve_config

from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams

SYSTEM = "You answer in one short line."
USER = "Name a river."
DEFAULT_MAX = 6


@pytest.fixture(scope="module")
def greedy(demo_worker, demo_model):
    """The model's greedy answer (40 tokens) to SYSTEM + USER, generated in-process, and
    the prompt's tokens."""
    ids = tuple(demo_model.tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": USER}]))
    events = list(demo_worker.generate(GenerateRequest(ids, max_tokens=40, sampling=SamplingParams(temperature=0))))
    assert events[-1].finish_reason is FinishReason.LENGTH  # no end-of-sequence in the way
    assert not any(e.reasoning for e in events)
    return "".join(e.text for e in events), ids


@pytest.fixture(scope="module")
def stop_string(greedy) -> str:
    """Two characters from the middle of the greedy answer, met there first."""
    text, _ = greedy
    for at in range(len(text) // 2, len(text) - 2):
        candidate = text[at:at + 2]
        if candidate.strip() and text.index(candidate) == at:
            return candidate
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, stop_string):
    quoted = stop_string.replace("\\", "\\\\").replace('"', '\\"')
    yaml_text = f"""\
server: {{decode_batch: 2, warmup: false}}
profiles:
  brief:
    temperature: 0.0
    max_tokens: {DEFAULT_MAX}
    system: {SYSTEM}
  stopping:
    temperature: 0.0
    max_tokens: 40
    system: {SYSTEM}
    stop: ["{quoted}"]
"""
    live = serve_config(tmp_path_factory.mktemp("profiles"), yaml_text)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def clients(served):
    return (openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=30, max_retries=0),
            anthropic.Anthropic(base_url=served.url, api_key="x", timeout=30, max_retries=0))


def test_the_system_prompt_is_read_before_the_users_turn(clients, greedy, demo_model):
    openai_client, anthropic_client = clients
    _, ids = greedy
    chat = openai_client.chat.completions.create(model="demo@brief", messages=[{"role": "user", "content": USER}])
    assert chat.usage.prompt_tokens == len(ids)
    message = anthropic_client.messages.create(model="demo@brief", max_tokens=2,
                                               messages=[{"role": "user", "content": USER}])
    usage = message.usage  # Anthropic's convention: prompt-cache reads counted apart
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == len(ids)
    response = openai_client.responses.create(model="demo", input=USER, max_output_tokens=2,
                                              extra_body={"profile": "brief"})
    assert response.usage.input_tokens == len(ids)
    # A request's own system prompt takes the profile's place.
    own = [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": USER}]
    mine = openai_client.chat.completions.create(model="demo@brief", messages=own)
    assert mine.usage.prompt_tokens == len(demo_model.tokenizer.encode_chat(own))


def test_the_default_max_tokens_caps_the_answer_unless_the_request_sets_one(clients, greedy):
    openai_client, _ = clients
    text, _ = greedy
    user = [{"role": "user", "content": USER}]
    capped = openai_client.chat.completions.create(model="demo@brief", messages=user)
    assert capped.usage.completion_tokens == DEFAULT_MAX and capped.choices[0].finish_reason == "length"
    assert text.startswith(capped.choices[0].message.content)
    completion = openai_client.completions.create(model="demo@brief", prompt="Once upon a time")
    assert completion.usage.completion_tokens == DEFAULT_MAX
    response = openai_client.responses.create(model="demo@brief", input=USER)
    assert response.usage.output_tokens == DEFAULT_MAX and response.status == "incomplete"
    mine = openai_client.chat.completions.create(model="demo@brief", messages=user, max_tokens=9)
    assert mine.usage.completion_tokens == 9 and text.startswith(mine.choices[0].message.content)


def test_the_stop_strings_end_the_answer_where_they_appear(clients, greedy, stop_string, served):
    openai_client, anthropic_client = clients
    text, _ = greedy
    before = text[: text.index(stop_string)]
    user = [{"role": "user", "content": USER}]
    chat = openai_client.chat.completions.create(model="demo@stopping", messages=user)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == before
    streamed = "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
        model="demo@stopping", messages=user, stream=True) if c.choices)
    assert streamed == before
    message = anthropic_client.messages.create(model="demo@stopping", max_tokens=40, messages=user)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop_string
    assert "".join(b.text for b in message.content if b.type == "text") == before
    response = openai_client.responses.create(model="demo@stopping", input=USER)
    assert response.status == "completed" and response.output_text == before
    # A request's own stop strings replace the profile's.
    with httpx.Client(base_url=served.url, timeout=30) as http:
        own = http.post("/v1/chat/completions", json={
            "model": "demo@stopping", "messages": user, "max_tokens": 40, "stop": ["\x00never"]}).json()
    assert own["choices"][0]["finish_reason"] == "length" and own["choices"][0]["message"]["content"] == text
