"""Tool calls, reasoning, thinking budgets and structured output through the worker,
on the demo model (its random weights are steered with grammars)."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.structured import Grammar, compile_format
from gmlx.engine.types import FinishReason, GenerateRequest, ResponseFormat, SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
    "required": ["name", "arguments"],
    # Compact JSON: a random model given free whitespace can loop on blanks forever.
    "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
}


def lark(text: str) -> Grammar:
    return Grammar(LLMatcher.grammar_from_lark(text), "lark")


def tool_prompt(demo_model) -> tuple[int, ...]:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    return tuple(demo_model.tokenizer.encode_chat(messages, tools=[WEATHER]))


def collect(worker, request):
    events = list(worker.generate(request))
    return events, events[-1]


def test_grammar_forced_tool_call_is_parsed(demo_worker, demo_model):
    grammar = lark('start: <tool_call> "\\n" call "\\n" </tool_call>\ncall: %json ' + json.dumps(CALL_SCHEMA))
    events, final = collect(demo_worker, GenerateRequest(
        tool_prompt(demo_model), max_tokens=120, sampling=SamplingParams(temperature=1.0, seed=2),
        grammar=grammar, tools=(WEATHER,)))
    calls = [c for e in events for c in e.tool_calls]
    assert final.finish_reason is FinishReason.TOOL_CALLS
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert "".join(e.text for e in events).strip() == ""  # the call is not content


def test_without_tools_the_same_text_stays_content(demo_worker, demo_model):
    grammar = lark('start: <tool_call> "\\n" call "\\n" </tool_call>\ncall: %json ' + json.dumps(CALL_SCHEMA))
    events, final = collect(demo_worker, GenerateRequest(
        tool_prompt(demo_model), max_tokens=120, sampling=SamplingParams(temperature=1.0, seed=2), grammar=grammar))
    assert final.finish_reason is FinishReason.STOP
    assert "get_weather" in "".join(e.text for e in events)


def test_reasoning_is_split_from_content(demo_worker, demo_model):
    grammar = lark('start: <think> "I should greet." </think> "Hello there"')
    prompt = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    events, final = collect(demo_worker, GenerateRequest(
        prompt, max_tokens=40, sampling=SamplingParams(temperature=0), grammar=grammar, split_reasoning=True))
    assert "".join(e.reasoning for e in events) == "I should greet."
    assert "".join(e.text for e in events) == "Hello there"
    assert final.finish_reason is FinishReason.STOP


def test_thinking_budget_closes_the_block(demo_worker, demo_model):
    tok = demo_model.tokenizer
    prompt = tuple(tok.encode_chat([{"role": "user", "content": "think"}]) + tok.encode("<think>\n", add_special_tokens=False))
    end_id = tok.token_to_id("</think>")
    eos = min(tok.eos_token_ids)
    # Bar the model from closing the block or stopping early, so only the budget can.
    params = SamplingParams(temperature=0, logit_bias={end_id: -100.0, eos: -100.0})
    events, _ = collect(demo_worker, GenerateRequest(
        prompt, max_tokens=12, sampling=params, thinking_budget=5, split_reasoning=True))
    ids = [t for e in events for t in e.token_ids]
    assert ids[5] == end_id
    assert all("</think>" not in e.text and "</think>" not in e.reasoning for e in events)
    assert "".join(e.reasoning for e in events)


def test_json_schema_output_validates(demo_worker, demo_model):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"],
    }
    grammar = compile_format(ResponseFormat(schema=schema, name="x"))
    prompt = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "json"}]))
    for seed in range(3):
        events, final = collect(demo_worker, GenerateRequest(
            prompt, max_tokens=60, sampling=SamplingParams(temperature=1.0, seed=seed), grammar=grammar))
        value = json.loads("".join(e.text for e in events))
        assert value["color"] in ("red", "green") and 0 <= value["n"] <= 9
        assert final.finish_reason is FinishReason.STOP


def test_malformed_schema_fails_before_generation():
    with pytest.raises(InvalidRequestError) as info:
        compile_format(ResponseFormat(schema={"type": "nonsense"}))
    assert info.value.param == "response_format"


def test_constrained_and_free_requests_share_a_batch(demo_worker, demo_model):
    """A grammar-constrained request decodes in the same batch as free ones, and
    neither changes the other's output."""
    grammar = compile_format(ResponseFormat(schema={
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}))
    prompt = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "batch"}]))

    def requests():
        return [GenerateRequest(prompt, max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=9), grammar=grammar),
                GenerateRequest(prompt, max_tokens=30, sampling=SamplingParams(temperature=0))]

    alone = ["".join(e.text for e in demo_worker.generate(r)) for r in requests()]
    handles = [demo_worker.submit(r) for r in requests()]
    together = ["".join(e.text for e in h) for h in handles]
    assert together == alone
    assert isinstance(json.loads(together[0])["n"], int)


def test_long_prefill_does_not_freeze_running_decodes(demo_model, monkeypatch):
    """Prefill runs in chunks between decode steps: a stream that is decoding keeps
    getting tokens while a long prompt is being prefilled. Counted on the worker's own
    thread (at each decode step of the running stream, the long request's state), so a
    reader that lags behind the worker changes nothing."""
    from gmlx.engine.requests import ActiveRequest
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=2, prefill_step_size=64, prompt_cache_bytes=0)
    states: list[str | None] = []  # the long request's state at each step of the running one

    def watch(tokens, logits):
        rows = {r["id"]: r["state"] for r in worker.rows()}
        states.append(rows.get("long"))
        return logits

    real = ActiveRequest.prepare.__func__

    def prepare(cls, handle, tokenizer, **kwargs):
        active = real(cls, handle, tokenizer, **kwargs)
        if handle.id == "running":
            active.processors.append(watch)
        return active

    monkeypatch.setattr(ActiveRequest, "prepare", classmethod(prepare))
    try:
        tok = demo_model.tokenizer
        running = worker.submit(GenerateRequest(
            tuple(tok.encode_chat([{"role": "user", "content": "go"}])), max_tokens=3000,
            sampling=SamplingParams(temperature=0), id="running"))
        events = iter(running)
        next(events)
        long_prompt = tuple(tok.encode_chat([{"role": "user", "content": "memory " * 1200}]))
        chunks = -(-len(long_prompt) // 64)
        long = worker.submit(GenerateRequest(long_prompt, max_tokens=1, sampling=SamplingParams(temperature=0),
                                             id="long"))
        assert list(long)[-1].final
        running.cancel()
        list(events)
        during_prefill = states.count("prefill")
        # A token streamed for every chunk of the long prompt (one chunk per decode step).
        assert during_prefill >= chunks - 1, (during_prefill, chunks)
    finally:
        worker.close()
