"""The Anthropic routes through the official ``anthropic`` SDK against a live server."""

from __future__ import annotations

import anthropic
import pytest

HI = [{"role": "user", "content": "Say hello."}]


def no_end(tokenizer) -> dict:
    """A request body's logit bias that bans the end of the turn: a sampled reply of the
    random-weight demo model may otherwise end within a test's few tokens."""
    return {"logit_bias": {str(t): -100 for t in tokenizer.eos_token_ids}}


def test_message(anthropic_client, demo_tokenizer):
    m = anthropic_client.messages.create(model="demo", max_tokens=5, messages=HI, extra_body=no_end(demo_tokenizer))
    assert m.type == "message" and m.role == "assistant" and m.model == "demo"
    assert m.content[0].type == "text" and isinstance(m.content[0].text, str)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5 and m.usage.input_tokens > 0


def test_stream_events_in_order(anthropic_client, demo_tokenizer):
    with anthropic_client.messages.stream(model="demo", max_tokens=4, messages=HI,
                                          extra_body=no_end(demo_tokenizer)) as stream:
        kinds = [e.type for e in stream if e.type != "text"]
        final = stream.get_final_message()
    ordered = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert ordered == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4


def test_raw_stream_matches_message(anthropic_client):
    events = list(
        anthropic_client.messages.create(
            model="demo", max_tokens=6, messages=HI, stream=True, extra_body={"temperature": 0}
        )
    )
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    whole = anthropic_client.messages.create(
        model="demo", max_tokens=6, messages=HI, extra_body={"temperature": 0}
    )
    assert text == whole.content[0].text


def prompt_tokens(usage) -> int:
    """The prompt's tokens: Anthropic's input_tokens leave out those read from the cache."""
    return usage.input_tokens + usage.cache_read_input_tokens


def test_system_and_stop_sequences(anthropic_client, demo_tokenizer):
    plain = anthropic_client.messages.create(model="demo", max_tokens=1, messages=HI)
    with_system = anthropic_client.messages.create(
        model="demo", max_tokens=1, messages=HI, system="You are terse."
    )
    assert prompt_tokens(with_system.usage) > prompt_tokens(plain.usage)
    (hello,) = demo_tokenizer.encode("hello", add_special_tokens=False)
    m = anthropic_client.messages.create(
        model="demo",
        max_tokens=6,
        messages=HI,
        stop_sequences=["lohel"],
        extra_body={"logit_bias": {str(hello): 100}, "temperature": 0},
    )
    assert m.content[0].text == "hel"
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "lohel"


def test_end_turn(anthropic_client, demo_tokenizer):
    eos = demo_tokenizer.token_to_id("<|im_end|>")
    m = anthropic_client.messages.create(
        model="demo", max_tokens=6, messages=HI, extra_body={"logit_bias": {str(eos): 100}}
    )
    assert m.stop_reason == "end_turn"


def test_count_tokens(anthropic_client):
    counted = anthropic_client.messages.count_tokens(model="demo", messages=HI)
    m = anthropic_client.messages.create(model="demo", max_tokens=1, messages=HI)
    assert counted.input_tokens == prompt_tokens(m.usage)  # the whole prompt, cached or not


def test_tool_turns_render(anthropic_client):
    tools = [
        {
            "name": "get_weather",
            "description": "Weather for a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny."}],
        },
    ]
    m = anthropic_client.messages.create(model="demo", max_tokens=2, messages=turns, tools=tools)
    bare = anthropic_client.messages.count_tokens(model="demo", messages=turns)
    assert prompt_tokens(m.usage) > bare.input_tokens  # the tools reached the template


def test_unknown_model_is_not_found(anthropic_client):
    with pytest.raises(anthropic.NotFoundError) as err:
        anthropic_client.messages.create(model="nope", max_tokens=2, messages=HI)
    assert err.value.body["error"]["available_models"] == ["demo", "tiny"]
