"""The token-to-text pipeline, step by step and as a chain, without a model.

A scripted byte tokenizer stands in for a real one: every token is one UTF-8 byte,
so a character of two or three bytes spans tokens, as byte-level BPE splits it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest

from gmlx.engine.pipeline import (
    Detokenize,
    Logprobs,
    SplitReasoning,
    SplitToolCalls,
    StopStrings,
    TextPipeline,
    pipeline_for,
)
from gmlx.engine.reasoning import ReasoningSplitter
from gmlx.engine.requests import ActiveRequest, RequestHandle
from gmlx.engine.tokenizer import IncrementalDetokenizer
from gmlx.engine.tools import ToolCallStream, ToolParser
from gmlx.engine.types import Event, FinishReason, GenerateRequest

HERMES = ToolParser("hermes", "<tool_call>", "</tool_call>", lambda text, tools: json.loads(text))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
VOCAB = 256


class ByteTokenizer:
    """Token ``i`` is the byte ``i``; decoding replaces an incomplete character with
    U+FFFD, as every real tokenizer does."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)  # type: ignore[arg-type]


TOK = ByteTokenizer()


def run(pipeline: TextPipeline, text: str, end: str | None = "length") -> list[Event]:
    """Feed ``text`` token by token, the last one with ``end``; the events it makes."""
    tokens = TOK.encode(text)
    events = [pipeline.feed(t) for t in tokens[:-1]]
    events.append(pipeline.feed(tokens[-1], end=end))
    return [e for e in events if e is not None]


def request(**fields: Any) -> GenerateRequest:
    return GenerateRequest((1, 2, 3), **fields)


# -- the steps, one at a time ---------------------------------------------------------


def test_detokenize_never_splits_a_character():
    step = Detokenize(TOK.detokenizer())
    e_acute = TOK.encode("é")  # two bytes
    assert step.feed(TOK.encode("a")[0]) == "a"
    assert step.feed(e_acute[0]) == ""  # half a character: held
    assert step.feed(e_acute[1]) == "é"
    assert step.finish() == ""


def test_detokenize_releases_what_it_holds_at_the_end():
    step = Detokenize(TOK.detokenizer())
    assert step.feed(TOK.encode("€")[0]) == ""
    assert step.finish() == "\ufffd"  # an incomplete character ends as U+FFFD


def test_stop_strings_cut_the_text_across_pieces():
    step = StopStrings(["END"])
    assert step.feed("one E") == ("one ", False)  # "E" may start the stop: held
    assert step.feed("N") == ("", False)
    assert step.feed("D and more") == ("", True)
    assert step.matched == "END"
    assert step.feed("after") == ("", True)  # stopped: nothing more
    assert step.finish() == ""


def test_stop_strings_release_the_held_text_at_the_end():
    step = StopStrings(["END"])
    assert step.feed("tail EN") == ("tail ", False)
    assert step.finish() == "EN"
    assert step.matched is None


def test_split_reasoning_releases_a_marker_start_as_text_at_the_end():
    step = SplitReasoning(ReasoningSplitter("<think>", "</think>"))
    assert step.feed("<think>hmm") == ("hmm", "")
    assert step.feed("</think>Yes <th") == ("", "Yes ")
    assert step.finish() == ("", "<th")


def test_split_tool_calls_emits_each_call_when_it_completes():
    step = SplitToolCalls(ToolCallStream(HERMES, [WEATHER]))
    assert step.feed("Sure. <tool_call>") == ("Sure.", ())
    assert not step.called
    content, calls = step.feed('{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert step.called
    assert step.finish() == ("", ())


def test_split_tool_calls_parses_a_call_the_output_ended_inside():
    step = SplitToolCalls(ToolCallStream(HERMES, [WEATHER]))
    assert step.feed('<tool_call>{"name": "get_weather", "arguments": {}}') == ("", ())
    content, calls = step.finish()
    assert content == "" and [c.name for c in calls] == ["get_weather"]


def test_logprobs_of_a_token_and_its_top_alternatives():
    row = mx.log(mx.array([0.1, 0.6, 0.3]))
    logprob, top = Logprobs(2).feed(2, row)
    assert logprob == pytest.approx(math.log(0.3))
    assert [t for t, _ in top] == [1, 2]
    assert top[0][1] == pytest.approx(math.log(0.6))
    assert Logprobs(0).feed(0, row)[1] == ()


# -- the chain ------------------------------------------------------------------------


def test_plain_text_streams_token_by_token_and_ends_at_the_length():
    pipeline = pipeline_for(request(), TOK)  # type: ignore[arg-type]
    events = run(pipeline, "héllo")
    assert "".join(e.text for e in events) == "héllo"
    assert [e.token_ids for e in events] == [(t,) for t in TOK.encode("héllo")]
    assert events[1].text == "" and events[2].text == "é"  # each token reported, text once whole
    assert all(e.logprob is None and e.top_logprobs == () for e in events)
    assert pipeline.finish is FinishReason.LENGTH and pipeline.stop_sequence is None


def test_an_end_of_sequence_token_adds_no_text_and_no_token():
    pipeline = pipeline_for(request(), TOK)  # type: ignore[arg-type]
    assert pipeline.feed(TOK.encode("A")[0]) == Event(pipeline.request_id, text="A", token_ids=(65,))
    assert pipeline.finish is None
    assert pipeline.feed(None, end="stop") is None  # nothing held: no event
    assert pipeline.finish is FinishReason.STOP


def test_a_stop_string_ends_the_output_and_is_named():
    pipeline = pipeline_for(request(stop=("lo",)), TOK)  # type: ignore[arg-type]
    events = run(pipeline, "hello world", end=None)
    assert "".join(e.text for e in events) == "hel"
    assert pipeline.finish is FinishReason.STOP and pipeline.stop_sequence == "lo"


def test_reasoning_is_split_from_the_answer():
    pipeline = pipeline_for(request(split_reasoning=True), TOK,  # type: ignore[arg-type]
                            think_markers=("<think>", "</think>"))
    events = run(pipeline, "<think>\nwhy\n</think>\n\nBecause.", end="stop")
    assert "".join(e.reasoning for e in events) == "why"
    assert "".join(e.text for e in events) == "Because."


def test_a_prompt_that_opens_the_thinking_block_starts_in_reasoning():
    pipeline = pipeline_for(request(split_reasoning=True), TOK,  # type: ignore[arg-type]
                            think_markers=("<think>", "</think>"), starts_inside=True)
    events = run(pipeline, "plan</think>done")
    assert "".join(e.reasoning for e in events) == "plan"
    assert "".join(e.text for e in events) == "done"


def test_a_call_at_the_end_of_sequence_finishes_with_tool_calls():
    pipeline = pipeline_for(request(tools=(WEATHER,)), TOK, tool_parser=HERMES)  # type: ignore[arg-type]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    events = run(pipeline, text, end=None)
    events.append(pipeline.feed(None, end="stop"))  # type: ignore[arg-type]
    events = [e for e in events if e is not None]
    calls = [c for e in events for c in e.tool_calls]
    assert "".join(e.text for e in events) == "Let me check."
    assert [c.name for c in calls] == ["get_weather"]
    assert pipeline.finish is FinishReason.TOOL_CALLS


def test_a_call_inside_the_reasoning_is_still_a_call():
    """A thinking model that calls before it closes its block (or never closes it) made
    a call: the call comes out of the reasoning, the thinking around it stays."""
    pipeline = pipeline_for(request(split_reasoning=True, tools=(WEATHER,)), TOK,  # type: ignore[arg-type]
                            think_markers=("<think>", "</think>"), starts_inside=True,
                            tool_parser=HERMES)
    text = ('I need the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            "\n</tool_call>\nWaiting.")
    events = run(pipeline, text, end="stop")
    assert [c.name for e in events for c in e.tool_calls] == ["get_weather"]
    assert "".join(e.reasoning for e in events) == "I need the weather.Waiting."
    assert "".join(e.text for e in events) == ""
    assert pipeline.finish is FinishReason.TOOL_CALLS and pipeline.called


def test_a_call_in_the_reasoning_and_one_in_the_answer_both_count():
    pipeline = pipeline_for(request(split_reasoning=True, tools=(WEATHER,)), TOK,  # type: ignore[arg-type]
                            think_markers=("<think>", "</think>"), tool_parser=HERMES)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    events = run(pipeline, f"<think>a {call % 'A'} b</think>Sure. {call % 'B'}", end="stop")
    calls = [json.loads(c.arguments)["city"] for e in events for c in e.tool_calls]
    assert calls == ["A", "B"]
    assert "".join(e.reasoning for e in events) == "ab"
    assert "".join(e.text for e in events) == "Sure."


def test_an_unfinished_call_in_the_reasoning_stays_reasoning():
    pipeline = pipeline_for(request(split_reasoning=True, tools=(WEATHER,)), TOK,  # type: ignore[arg-type]
                            think_markers=("<think>", "</think>"), starts_inside=True,
                            tool_parser=HERMES)
    events = run(pipeline, 'maybe <tool_call>{"name": "get_w')
    assert "".join(e.reasoning for e in events) == 'maybe <tool_call>{"name": "get_w'
    assert not pipeline.called and pipeline.finish is FinishReason.LENGTH


def test_a_call_cut_by_the_length_still_finishes_with_length():
    pipeline = pipeline_for(request(tools=(WEATHER,)), TOK, tool_parser=HERMES)  # type: ignore[arg-type]
    run(pipeline, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert pipeline.finish is FinishReason.LENGTH


def test_without_a_parser_tool_text_stays_content():
    pipeline = pipeline_for(request(tools=(WEATHER,)), TOK)  # type: ignore[arg-type]
    text = '<tool_call>{"name": "get_weather"}</tool_call>'
    events = run(pipeline, text, end="stop")
    assert "".join(e.text for e in events) == text
    assert pipeline.tools is None and pipeline.finish is FinishReason.STOP


def test_a_required_call_that_never_came_is_a_warning(caplog):
    pipeline = pipeline_for(request(tools=(WEATHER,), tool_choice_forced=True), TOK,  # type: ignore[arg-type]
                            tool_parser=HERMES)
    with caplog.at_level(logging.WARNING, logger="gmlx.engine"):
        run(pipeline, "No tools today.")
    assert "a tool call was required but the model made none" in caplog.text


def test_logprobs_ride_on_each_token_event():
    pipeline = pipeline_for(request(logprobs=True, top_logprobs=1), TOK)  # type: ignore[arg-type]
    row = mx.log(mx.full((VOCAB,), 1 / VOCAB))
    event = pipeline.feed(66, row)
    assert event is not None and event.token_ids == (66,)
    assert event.logprob == pytest.approx(-math.log(VOCAB))
    assert len(event.top_logprobs) == 1


def test_a_request_gets_only_the_steps_it_asks_for():
    plain = pipeline_for(request(), TOK, think_markers=("<think>", "</think>"),  # type: ignore[arg-type]
                         tool_parser=HERMES)
    assert plain.reasoning is None and plain.tools is None and plain.logprobs is None
    full = pipeline_for(request(split_reasoning=True, tools=(WEATHER,), logprobs=True, top_logprobs=3),
                        TOK, think_markers=("<think>", "</think>"), tool_parser=HERMES)  # type: ignore[arg-type]
    assert full.reasoning is not None and full.tools is not None and full.logprobs is not None
    assert full.logprobs.top == 3


# -- the request that owns the pipeline -----------------------------------------------


def test_a_first_token_handed_out_early_is_not_counted_twice():
    """The worker hands a first token out before mlx-lm returns it; when mlx-lm does,
    it is neither counted nor emitted again, and only an ending it brings is news."""
    emitted: list[Event] = []
    handle = RequestHandle(request(max_tokens=3), cancel=lambda request_id: None)
    handle._emit = emitted.append  # type: ignore[method-assign]
    active = ActiveRequest(handle, pipeline_for(handle.request, TOK))  # type: ignore[arg-type]
    assert active.take(72, None, None) is None  # "H", handed out early
    active.handed_out = 72
    assert active.take(72, None, None) is None  # mlx-lm returns it: nothing new
    assert active.take(105, None, "length") is FinishReason.LENGTH
    assert active.generated == 2
    assert [(e.text, e.token_ids) for e in emitted] == [("H", (72,)), ("i", (105,))]
    active.finish(FinishReason.LENGTH)
    assert emitted[-1].final and emitted[-1].usage.completion_tokens == 2  # type: ignore[union-attr]


def test_a_handle_cancels_through_its_callable_only():
    cancelled: list[str] = []
    handle = RequestHandle(request(), cancel=cancelled.append)
    handle.cancel()
    assert cancelled == [handle.id]
    assert not any("worker" in name for name in vars(handle))
