"""The OpenAI routes through the official ``openai`` SDK against a live server."""

from __future__ import annotations

import openai
import pytest

HI = [{"role": "user", "content": "Say hello."}]


def token(tokenizer, text: str) -> int:
    (tid,) = tokenizer.encode(text, add_special_tokens=False)
    return tid


def no_eos(tokenizer) -> dict[str, int]:
    """A logit bias that bans the end of the turn: a sampled reply of the random-weight
    demo model may otherwise end within a test's few tokens."""
    return {str(t): -100 for t in tokenizer.eos_token_ids}


def test_chat_completion(openai_client, demo_tokenizer):
    r = openai_client.chat.completions.create(model="demo", messages=HI, max_tokens=6, logit_bias=no_eos(demo_tokenizer))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == "demo"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_stream_role_first_and_usage_last(openai_client, demo_tokenizer):
    stream = openai_client.chat.completions.create(
        model="demo",
        messages=HI,
        max_tokens=5,
        logit_bias=no_eos(demo_tokenizer),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1


def test_seed_repeats_and_explicit_fields_change_output(openai_client):
    def ask(**kw):
        r = openai_client.chat.completions.create(model="demo", messages=HI, max_tokens=8, **kw)
        return r.choices[0].message.content

    assert ask(seed=7, temperature=1.0) == ask(seed=7, temperature=1.0)
    assert ask(temperature=0) == ask(temperature=0, seed=99)  # greedy ignores the seed
    outs = {ask(seed=s, temperature=1.5, extra_body={"top_k": 0}) for s in range(4)}
    assert len(outs) > 1


def test_logit_bias_and_stop(openai_client, demo_tokenizer):
    hello = token(demo_tokenizer, "hello")
    forced = openai_client.chat.completions.create(
        model="demo", messages=HI, max_tokens=4, temperature=0, logit_bias={str(hello): 100}
    )
    assert forced.choices[0].message.content == "hello" * 4
    stopped = openai_client.chat.completions.create(
        model="demo",
        messages=HI,
        max_tokens=4,
        temperature=0,
        logit_bias={str(hello): 100},
        stop=["llo"],
    )
    assert stopped.choices[0].message.content == "he"
    assert stopped.choices[0].finish_reason == "stop"


def test_max_completion_tokens_wins(openai_client, demo_tokenizer):
    r = openai_client.chat.completions.create(
        model="demo", messages=HI, max_tokens=9, max_completion_tokens=3, logit_bias=no_eos(demo_tokenizer)
    )
    assert r.usage.completion_tokens == 3


def test_profiles_alias_and_explicit_override(openai_client):
    plain = openai_client.chat.completions.create(model="demo", messages=HI, max_tokens=2)
    coder = openai_client.chat.completions.create(model="coder", messages=HI)
    assert coder.usage.completion_tokens == 5  # the profile's max_tokens
    assert coder.usage.prompt_tokens > plain.usage.prompt_tokens  # its system prompt
    override = openai_client.chat.completions.create(model="coder", messages=HI, max_tokens=2)
    assert override.usage.completion_tokens == 2
    via_field = openai_client.chat.completions.create(
        model="demo", messages=HI, extra_body={"profile": "qwen-coder"}
    )
    assert via_field.usage.completion_tokens == 5
    suffix = openai_client.chat.completions.create(model="demo@qwen-coder", messages=HI)
    assert suffix.choices[0].message.content == coder.choices[0].message.content  # greedy


def test_unknown_model_and_profile(openai_client):
    with pytest.raises(openai.NotFoundError) as nf:
        openai_client.chat.completions.create(model="nope", messages=HI, max_tokens=2)
    assert nf.value.body["available_models"] == ["demo", "tiny"]
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(
            model="demo", messages=HI, max_tokens=2, extra_body={"profile": "nope"}
        )
    assert bad.value.body["type"] == "unknown_profile"


def test_tools_reach_the_template(openai_client):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    base = openai_client.chat.completions.create(model="demo", messages=HI, max_tokens=1)
    with_tools = openai_client.chat.completions.create(
        model="demo", messages=HI, max_tokens=1, tools=tools
    )
    stripped = openai_client.chat.completions.create(
        model="demo", messages=HI, max_tokens=1, tools=tools, tool_choice="none"
    )
    assert with_tools.usage.prompt_tokens > base.usage.prompt_tokens
    assert stripped.usage.prompt_tokens == base.usage.prompt_tokens


def test_completions(openai_client, demo_tokenizer):
    r = openai_client.completions.create(model="demo", prompt="Once upon", max_tokens=4)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.prompt_tokens == len(demo_tokenizer.encode("Once upon"))  # no template
    chunks = list(
        openai_client.completions.create(
            model="demo",
            prompt="Once upon",
            max_tokens=4,
            logit_bias=no_eos(demo_tokenizer),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3]},
        {"n": 2},
        {"echo": True},
        {"suffix": "end"},
        {"best_of": 2},
    ],
)
def test_completions_rejects(openai_client, extra):
    args = {"model": "demo", "prompt": "hi", "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(**args)


def test_responses(openai_client, demo_tokenizer):
    # Every request runs to its cap: a random model's greedy choice may otherwise end early
    # when other tests' requests share its batch.
    no_eos = {"logit_bias": {str(t): -100 for t in demo_tokenizer.eos_token_ids}}
    r = openai_client.responses.create(
        model="demo", input="Hello", instructions="Be brief.", max_output_tokens=4, extra_body=no_eos
    )
    assert r.object == "response" and r.status == "incomplete"
    assert isinstance(r.output_text, str) and r.usage.output_tokens == 4
    events = list(
        openai_client.responses.create(
            model="demo",
            input=[{"role": "user", "content": "Hello"}],
            max_output_tokens=3,
            stream=True,
            extra_body=no_eos,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    with openai_client.responses.stream(model="demo", input="Hi", max_output_tokens=2, extra_body=no_eos) as s:
        assert s.get_final_response().usage.output_tokens == 2


def test_responses_completed_when_the_model_stops(openai_client, demo_tokenizer):
    eos = demo_tokenizer.token_to_id("<|im_end|>")
    events = list(
        openai_client.responses.create(
            model="demo",
            input="Hello",
            max_output_tokens=5,
            stream=True,
            extra_body={"logit_bias": {str(eos): 100}},
        )
    )
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "completed"
    chat = openai_client.chat.completions.create(
        model="demo", messages=HI, max_tokens=5, logit_bias={str(eos): 100}
    )
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == ""


def test_models_listing(openai_client):
    rows = {m.id: m.model_dump() for m in openai_client.models.list()}
    assert set(rows) == {"demo", "tiny", "coder"}
    demo = rows["demo"]
    for marker in (
        "resident",
        "pinned",
        "speculative",
        "vlm",
        "profile",
        "default",
        "context_length",
        "max_context_at_width_1",
    ):
        assert marker in demo
    assert demo["resident"] and demo["default"] and demo["profile"] == "chat"
    # demo is the model the boot capacity table was built for: a number, at most the window.
    assert demo["context_length"] == 8192 and 0 < demo["max_context_at_width_1"] <= 8192
    assert rows["coder"]["alias_of"] == "demo" and rows["coder"]["profile"] == "qwen-coder"
