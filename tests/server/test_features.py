"""Structured output, tool calls, logprobs, samplers and reasoning through the real
server and the official SDKs (issue: the request features agents depend on)."""

from __future__ import annotations

import json
import math

import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "where": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 8}},
            "required": ["country"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "population", "size", "tags", "where"],
    "additionalProperties": False,  # without it a random model invents keys until max_tokens
}
USER = [{"role": "user", "content": "Name a city."}]


def check(value: dict) -> None:
    """The SCHEMA's constraints, checked by hand."""
    assert set(value) == set(SCHEMA["required"])
    assert isinstance(value["city"], str) and len(value["city"]) <= 10
    assert isinstance(value["population"], int) and 0 <= value["population"] <= 100000
    assert value["size"] in ("small", "large")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(isinstance(t, str) and len(t) <= 5 for t in value["tags"])
    assert isinstance(value["where"]["country"], str)


RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_non_stream_validates(openai_client, seed):
    r = openai_client.chat.completions.create(
        model="demo", messages=USER, response_format=RF, temperature=1.0, seed=seed, max_tokens=500)
    assert r.choices[0].finish_reason == "stop"
    check(json.loads(r.choices[0].message.content))


def test_json_schema_stream_validates(openai_client):
    stream = openai_client.chat.completions.create(
        model="demo", messages=USER, response_format=RF, temperature=1.0, seed=3, max_tokens=500, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check(json.loads(text))


def test_json_object(openai_client):
    r = openai_client.chat.completions.create(
        model="demo", messages=USER, response_format={"type": "json_object"}, temperature=1.0, seed=5,
        max_tokens=300)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.startswith("{")


def test_bad_response_formats_are_400(http):
    for rf in [{"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
               {"type": "json_schema", "json_schema": {"name": "x"}},
               {"type": "yaml"}]:
        r = http.post("/v1/chat/completions", json={"model": "demo", "messages": USER, "response_format": rf})
        assert r.status_code == 400, rf
        assert r.json()["error"]["param"] == "response_format"


def test_anthropic_output_config(anthropic_client):
    msg = anthropic_client.messages.create(
        model="demo", max_tokens=500, messages=USER,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "seed": 4,
                    "temperature": 1.0})
    check(json.loads(msg.content[0].text))


def test_responses_text_format(openai_client):
    r = openai_client.responses.create(
        model="demo", input="Name a city.", max_output_tokens=500, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}, extra_body={"seed": 6})
    check(json.loads(r.output_text))


# -- tools ------------------------------------------------------------------------


def test_required_tool_call_non_stream(openai_client):
    r = openai_client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", temperature=1.0, seed=1, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_required_tool_call_stream(openai_client):
    stream = openai_client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=2,
        max_tokens=200, stream=True)
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].index == 0


def test_tool_result_round_trip_renders(openai_client, demo_tokenizer):
    """A tool result sent back renders through the template (and generates)."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = openai_client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=3)
    rendered = demo_tokenizer.render_chat(messages, tools=[WEATHER])
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in rendered
    assert r.usage.prompt_tokens == len(demo_tokenizer.encode(rendered, add_special_tokens=False))


def test_tool_choice_none_strips_tools(http, demo_tokenizer):
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    with_tools = http.post("/v1/messages/count_tokens", json={**body, "tools": [
        {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}).json()["input_tokens"]
    r = http.post("/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] < with_tools
    plain = len(demo_tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    assert r["usage"]["prompt_tokens"] == plain


def test_anthropic_tool_use(anthropic_client):
    tool = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}
    msg = anthropic_client.messages.create(
        model="demo", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}], tools=[tool],
        tool_choice={"type": "any"}, extra_body={"seed": 3, "temperature": 1.0})
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "get_weather" and isinstance(block.input["city"], str)

    with anthropic_client.messages.stream(
        model="demo", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}], tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"seed": 3, "temperature": 1.0},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.name for b in final.content if b.type == "tool_use"] == ["get_weather"]

    # The result goes back as a tool_result block.
    follow = anthropic_client.messages.create(
        model="demo", max_tokens=3, tools=[tool], messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name,
                                               "input": block.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]},
        ])
    def prompt(usage) -> int:  # Anthropic's input_tokens leave out the cached ones
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt(follow.usage) > prompt(msg.usage)


def test_responses_function_call(openai_client):
    r = openai_client.responses.create(
        model="demo", input="Weather?", max_output_tokens=200, temperature=1.0,
        tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required", extra_body={"seed": 1})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    json.loads(calls[0].arguments)
    with openai_client.responses.stream(
        model="demo", input="Weather?", max_output_tokens=200, temperature=1.0,
        tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required", extra_body={"seed": 1},
    ) as stream:
        final = stream.get_final_response()
    assert [o.name for o in final.output if o.type == "function_call"] == ["get_weather"]


# -- logprobs -----------------------------------------------------------------------


def test_logprobs_non_stream_join_to_the_text(openai_client):
    r = openai_client.chat.completions.create(
        model="demo", messages=USER, logprobs=True, max_tokens=12, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob <= 0 and t.top_logprobs == [] for t in content)  # TOP_LOGPROBS_K is 0


def test_logprobs_stream_and_top_cap(openai_client, server, monkeypatch):
    # The cap is read once, into settings (TOP_LOGPROBS_K): this server's engine gets 2.
    monkeypatch.setattr(server.app.state.engine, "top_logprobs_cap", 2)
    stream = openai_client.chat.completions.create(
        model="demo", messages=USER, logprobs=True, top_logprobs=5, max_tokens=10, temperature=0, stream=True)
    text, entries = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                entries += chunk.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == text
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)
    # Greedy: each chosen token is the most likely one.
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in entries)


def test_greedy_logprobs_are_log_probabilities_and_change_no_text(openai_client, server, monkeypatch):
    # A greedy decode step computes log-probabilities only where a request asks for them.
    monkeypatch.setattr(server.app.state.engine, "top_logprobs_cap", 2)
    asked = openai_client.chat.completions.create(
        model="demo", messages=USER, logprobs=True, top_logprobs=2, max_tokens=12, temperature=0)
    plain = openai_client.chat.completions.create(model="demo", messages=USER, max_tokens=12, temperature=0)
    content = asked.choices[0].logprobs.content
    assert len(content) == 12
    for t in content:
        assert math.isfinite(t.logprob) and t.logprob <= 0
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == asked.choices[0].message.content


def test_timings_per_token(http):
    # Greedy, so exactly max_tokens: the model's "chat" profile samples at temperature 0.7
    # with no seed, and an unseeded draw ends early by chance (about 1 run in 60 here).
    # Batching changes nothing: a greedy request's tokens are the same alone or sharing
    # its batch (tests/engine/test_worker.py, test_isolation.py).
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "demo", "messages": USER, "max_tokens": 6, "temperature": 0, "stream": True,
            "timings_per_token": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["timings"]["predicted_n"] for c in chunks if "timings" in c]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_timings_count_an_end_of_sequence_token_as_usage_does(http, demo_tokenizer):
    # Forced to end at once: the end-of-sequence token is decoded (usage counts it) but
    # never sent; the final chunk's predicted_n must still agree with the usage.
    eos = {str(t): 100 for t in demo_tokenizer.eos_token_ids}
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "demo", "messages": USER, "max_tokens": 6, "stream": True, "timings_per_token": True,
            "logit_bias": eos, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = next(c for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"])
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"] == 1


# -- samplers and reasoning over HTTP ---------------------------------------------------


def test_logit_bias_on_every_protocol(openai_client, anthropic_client, demo_tokenizer):
    forced = demo_tokenizer.encode(" weather", add_special_tokens=False)[0]
    bias = {str(forced): 100}
    chat = openai_client.chat.completions.create(model="demo", messages=USER, max_tokens=4, logit_bias=bias)
    assert chat.choices[0].message.content == " weather" * 4
    resp = openai_client.responses.create(model="demo", input="x", max_output_tokens=4, extra_body={"logit_bias": bias})
    assert resp.output_text == " weather" * 4
    msg = anthropic_client.messages.create(model="demo", max_tokens=4, messages=USER, extra_body={"logit_bias": bias})
    assert msg.content[0].text == " weather" * 4


def test_new_samplers_are_honoured_not_warned(openai_client, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="gmlx.server"):
        a = openai_client.chat.completions.create(
            model="demo", messages=USER, max_tokens=8, temperature=2.0, seed=1,
            extra_body={"top_n_sigma": 1e-6, "typical_p": 0.9, "xtc_probability": 0.0, "p_less": False})
    greedy = openai_client.chat.completions.create(model="demo", messages=USER, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == greedy.choices[0].message.content
    assert not [r for r in caplog.records if "ignored parameters" in r.getMessage()]


def test_reasoning_effort_reaches_the_template(http):
    bad = http.post("/v1/chat/completions", json={"model": "demo", "messages": USER, "reasoning_effort": "huge"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    ok = http.post("/v1/chat/completions", json={"model": "demo", "messages": USER, "max_tokens": 2,
                                                   "reasoning_effort": "low", "thinking_budget": 4})
    assert ok.status_code == 200


# -- reasoning: the demo template opens <think> when enable_thinking is on -----------------


def think_bias(tokenizer) -> dict[str, float]:
    """Bar the random model from closing the block itself, so the budget closes it."""
    return {str(tokenizer.token_to_id("</think>")): -100}


def test_chat_reasoning_content_and_budget(openai_client, demo_tokenizer):
    r = openai_client.chat.completions.create(
        model="demo", messages=USER, max_tokens=12, temperature=0, logit_bias=think_bias(demo_tokenizer),
        extra_body={"enable_thinking": True, "thinking_budget": 4})
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in (message.content or "")
    # The budget closed the block: the rest is content. Without a budget the (barred)
    # model never closes it and all 12 tokens are reasoning.
    assert message.content
    unbounded = openai_client.chat.completions.create(
        model="demo", messages=USER, max_tokens=12, temperature=0, logit_bias=think_bias(demo_tokenizer),
        extra_body={"enable_thinking": True})
    assert not unbounded.choices[0].message.content
    assert len(unbounded.choices[0].message.model_extra["reasoning_content"]) > len(reasoning)

    stream = openai_client.chat.completions.create(
        model="demo", messages=USER, max_tokens=12, temperature=0, logit_bias=think_bias(demo_tokenizer),
        extra_body={"enable_thinking": True, "thinking_budget": 4}, stream=True)
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in stream if c.choices)
    assert streamed == reasoning


def test_without_thinking_there_is_no_reasoning(openai_client):
    r = openai_client.chat.completions.create(model="demo", messages=USER, max_tokens=6, temperature=0)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_anthropic_thinking_blocks(anthropic_client, demo_tokenizer):
    kwargs = {"model": "demo", "max_tokens": 12, "messages": USER,
              "thinking": {"type": "enabled", "budget_tokens": 4},
              "extra_body": {"temperature": 0, "logit_bias": think_bias(demo_tokenizer)}}
    msg = anthropic_client.messages.create(**kwargs)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking
    with anthropic_client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == msg.content[0].thinking


def test_responses_reasoning_item(openai_client, demo_tokenizer):
    kwargs = {"model": "demo", "input": "hi", "max_output_tokens": 12, "reasoning": {"effort": "low"},
              "extra_body": {"temperature": 0, "thinking_budget": 4,
                             "logit_bias": think_bias(demo_tokenizer)}}
    r = openai_client.responses.create(**kwargs)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    with openai_client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == r.output[0].content[0].text
