"""Tool calls: parser choice from the template, streaming splits, tool_choice."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.tools import (
    ToolCallStream,
    ToolParser,
    select_tools,
    template_tool_choice,
    template_tools,
    tool_parser_for,
)
from gmlx.engine.types import Tool, ToolCall, ToolChoice, ToolChoiceMode

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]


def fake_tokenizer(template: str | None, vocab: dict[str, int] | None = None) -> Any:
    """What tool_parser_for reads: the template, and the vocab through ``hf``."""
    hf = SimpleNamespace(chat_template=template, get_vocab=lambda: vocab or {})
    return SimpleNamespace(chat_template=template, hf=hf)


def parser_named(name: str) -> ToolParser:
    templates = {
        "json_tools": "<tool_call>{{ tool_call.name }}</tool_call>",
        "mistral": "[TOOL_CALLS]",
        "pythonic": "<|tool_call_start|>",
        "function_gemma": "<start_function_call>",
        "gemma4": "<|tool_call>call:{{ name }}<tool_call|>",
        "llama3_json": "<|start_header_id|>ipython<|end_header_id|><|python_tag|>",
        "pythonic_bare": "[func_name1(params_name1=params_value1)]",
    }
    parser = tool_parser_for(fake_tokenizer(templates[name]))
    assert parser is not None and parser.name == name
    return parser


def chunkings(text: str) -> list[list[str]]:
    """The text split every way that matters: per character, in small strides, and
    in two at every position (so every marker is split at every offset)."""
    out = [[text], list(text)]
    for stride in (2, 3, 5, 7):
        out.append([text[i : i + stride] for i in range(0, len(text), stride)])
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    return out


def run(parser: ToolParser, chunks: list[str], tools=TOOLS) -> list[Any]:
    """Feed chunks, finish, and merge adjacent text items (chunking-independent)."""
    stream = ToolCallStream(parser, tools)
    items = [item for c in chunks for item in stream.feed(c)] + stream.finish()
    merged: list[Any] = []
    for item in items:
        assert item != ""  # no empty text items
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    return merged


def shape(items: list[Any]) -> list[Any]:
    """Items with calls as (name, arguments-object) for comparison."""
    return [(i.name, json.loads(i.arguments)) if isinstance(i, ToolCall) else i for i in items]


def check_every_split(parser: ToolParser, text: str, expected: list[Any]) -> None:
    for chunks in chunkings(text):
        assert shape(run(parser, chunks)) == expected, chunks


# -- choosing the parser ----------------------------------------------------------


@pytest.mark.parametrize("name", ["json_tools", "mistral", "pythonic", "function_gemma",
                                  "gemma4", "llama3_json", "pythonic_bare"])
def test_parser_is_inferred_from_the_template(name):
    parser_named(name)


def test_llama32_json_template_without_python_tag():
    template = ('<|start_header_id|>user<|end_header_id|>Respond in the format '
                '{"name": function name, "parameters": dictionary of argument name}')
    assert tool_parser_for(fake_tokenizer(template)).name == "llama3_json"


def test_no_tool_syntax_no_parser():
    assert tool_parser_for(fake_tokenizer("{{ messages[0].content }}")) is None
    assert tool_parser_for(fake_tokenizer(None)) is None


def test_demo_template_gets_hermes_json(demo_model):
    parser = tool_parser_for(demo_model.tokenizer)
    assert (parser.name, parser.start, parser.end) == ("json_tools", "<tool_call>", "</tool_call>")


def test_gemma4_fixture_template():
    from gmlx.engine.loading.gguf_file import GGUFFile
    from tests.conftest import vocab_path

    template = GGUFFile(vocab_path("gemma-4")).metadata["tokenizer.chat_template"]
    assert tool_parser_for(fake_tokenizer(template)).name == "gemma4"


# -- streaming, per syntax --------------------------------------------------------


def test_hermes_text_then_two_calls_then_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            "Done.")
    check_every_split(parser_named("json_tools"), text, [
        "Let me check.", ("get_weather", {"city": "Paris"}), ("get_time", {}), "Done."])


def test_hermes_call_emitted_as_soon_as_its_end_marker_arrives():
    stream = ToolCallStream(parser_named("json_tools"), TOOLS)
    assert stream.feed("Hi <tool") == ["Hi"]  # "<tool" might open a call, " " waits
    assert stream.feed('_call>{"name": "get_time", "arguments": {}}') == []
    (call,) = stream.feed("</tool_call>")
    assert call.name == "get_time" and call.arguments == "{}"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert stream.finish() == [] and stream.calls == [call]


def test_text_that_only_looks_like_a_marker_passes_through():
    check_every_split(parser_named("json_tools"), "a <tool and <tool_cal b <",
                      ["a <tool and <tool_cal b <"])


def test_whitespace_only_text_is_kept_when_there_is_no_call():
    assert run(parser_named("json_tools"), ["\n", " "]) == ["\n "]
    assert run(parser_named("json_tools"), ["a ", " b\n"]) == ["a  b\n"]


def test_malformed_call_is_kept_as_text():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    check_every_split(parser_named("json_tools"), "x" + bad + "y", ["x" + bad + "y"])


def test_unterminated_call_that_parses_is_a_call_and_one_that_does_not_is_text():
    parser = parser_named("json_tools")
    assert shape(run(parser, ['<tool_call>{"name": "get_time", "arguments": {}}'])) == [
        ("get_time", {})]
    assert run(parser, ['ok <tool_call>{"name": "get_ti']) == ['ok <tool_call>{"name": "get_ti']


def test_arguments_given_as_a_json_string_are_normalised():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert shape(run(parser_named("json_tools"), [text])) == [("get_weather", {"city": "Oslo"})]


def test_call_ids_are_unique():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 3
    calls = run(parser_named("json_tools"), [text])
    assert len(calls) == 3 and len({c.id for c in calls}) == 3


def test_mistral_json_list_and_header_forms():
    parser = parser_named("mistral")
    check_every_split(parser, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": '
                              '{"city": "Rome"}}, {"name": "get_time", "arguments": {}}]',
                      ["Sure.", ("get_weather", {"city": "Rome"}), ("get_time", {})])
    check_every_split(parser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
                      [("get_weather", {"city": "Rome"})])


def test_mistral_broken_call_is_text():
    assert run(parser_named("mistral"), ["[TOOL_CALLS]get_weather[ARGS]{"]) == [
        "[TOOL_CALLS]get_weather[ARGS]{"]


def test_llama3_python_tag_and_bare_json():
    parser = parser_named("llama3_json")
    check_every_split(parser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}',
                      [("get_weather", {"city": "Lima"})])
    check_every_split(parser, '\n{"name": "get_weather", "parameters": {"city": "Lima"}}; '
                              '{"name": "get_time", "parameters": {}}',
                      [("get_weather", {"city": "Lima"}), ("get_time", {})])


def test_llama3_json_answer_that_is_not_a_call_stays_text():
    parser = parser_named("llama3_json")
    check_every_split(parser, '{"answer": 42}', ['{"answer": 42}'])
    check_every_split(parser, 'The answer is {"a": 1}', ['The answer is {"a": 1}'])


def test_pythonic_with_markers():
    text = 'Ok <|tool_call_start|>[get_weather(city="Kyiv"), get_time()]<|tool_call_end|> bye'
    check_every_split(parser_named("pythonic"), text,
                      ["Ok", ("get_weather", {"city": "Kyiv"}), ("get_time", {}), "bye"])


def test_bare_pythonic_answer():
    parser = parser_named("pythonic_bare")
    check_every_split(parser, '[get_weather(city="Nice")]', [("get_weather", {"city": "Nice"})])
    check_every_split(parser, "[1, 2] are numbers", ["[1, 2] are numbers"])


def test_gemma4_calls():
    text = ('<|tool_call>call:get_weather{city:<|"|>Bern<|"|>}<tool_call|>'
            '<|tool_call>call:get_time{}<tool_call|>')
    check_every_split(parser_named("gemma4"), text, [("get_weather", {"city": "Bern"}),
                                                     ("get_time", {})])


def test_function_gemma_call():
    text = "Hm. <start_function_call>call:get_weather{city:<escape>Oslo<escape>}<end_function_call>"
    check_every_split(parser_named("function_gemma"), text,
                      ["Hm.", ("get_weather", {"city": "Oslo"})])


# -- the demo template, round trip ------------------------------------------------


def test_demo_template_renders_calls_and_results_and_they_parse_back(demo_model):
    tok = demo_model.tokenizer
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    ]
    text = tok.render_chat(messages, tools=TOOLS)
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]  # the tools are listed
    turn = text.split("<|im_start|>assistant", 1)[1].split("<|im_end|>", 1)[0]
    assert shape(run(tool_parser_for(tok), [turn])) == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    # Consecutive tool results share one user turn, in order.
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
            "<tool_response>\n12:00\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n")


def test_demo_tokens_stream_into_a_call(demo_model):
    """Decoded token by token (special tokens and all), a call still comes out whole."""
    tok = demo_model.tokenizer
    ids = tok.encode('Sure<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
                     "\n</tool_call>", add_special_tokens=False)
    assert tok.token_to_id("<tool_call>") in ids
    detok = tok.detokenizer()
    chunks = [detok.add(t) for t in ids] + [detok.flush()]
    assert shape(run(tool_parser_for(tok), chunks)) == ["Sure", ("get_weather", {"city": "Tokyo"})]


# -- tool_choice ------------------------------------------------------------------

W, T = Tool("get_weather", parameters={"type": "object"}), Tool("get_time")


def test_select_tools_by_mode():
    assert select_tools((W, T), ToolChoice()) == ((W, T), False)
    assert select_tools((W, T), ToolChoice(ToolChoiceMode.NONE)) == ((), False)
    assert select_tools((W, T), ToolChoice(ToolChoiceMode.REQUIRED)) == ((W, T), True)
    assert select_tools((W, T), ToolChoice(ToolChoiceMode.NAMED, "get_time")) == ((T,), True)
    assert select_tools((), ToolChoice()) == ((), False)


@pytest.mark.parametrize("tools, choice", [
    ((W, T), ToolChoice(ToolChoiceMode.NAMED, "nope")),
    ((), ToolChoice(ToolChoiceMode.REQUIRED)),
])
def test_select_tools_refuses_what_cannot_be_honoured(tools, choice):
    with pytest.raises(InvalidRequestError) as info:
        select_tools(tools, choice)
    assert info.value.param == "tool_choice"


def test_template_forms():
    assert template_tools(()) is None
    assert template_tools((W, Tool("f", "does f", None, {"strict": True}))) == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "description": "does f", "strict": True}},
    ]
    assert template_tool_choice(ToolChoice()) is None
    assert template_tool_choice(ToolChoice(ToolChoiceMode.REQUIRED)) == "required"
    assert template_tool_choice(ToolChoice(ToolChoiceMode.NAMED, "f")) == {
        "type": "function", "function": {"name": "f"}}


# -- arguments are always JSON ------------------------------------------------------


def test_a_number_beyond_a_double_keeps_the_models_own_text():
    """1e999 parses to infinity, which JSON cannot write: the model's text stays."""
    text = '<tool_call>{"name": "get_time", "arguments": {"n": 1e999, "s": "ü"}}</tool_call>'
    (call,) = run(parser_named("json_tools"), [text])
    assert call.arguments == '{"n": 1e999, "s": "ü"}'
    assert json.loads(call.arguments)["n"] == float("inf")  # valid JSON, as clients read it
    as_string = '<tool_call>{"name": "get_time", "arguments": "{\\"n\\": -2E+400}"}</tool_call>'
    (call,) = run(parser_named("json_tools"), [as_string])
    assert call.arguments == '{"n": -2E+400}'


@pytest.mark.parametrize("args", ['{"n": NaN}', '{"n": Infinity}', '"{\\"n\\": NaN}"'])
def test_arguments_json_cannot_hold_make_the_call_text(args):
    text = f'<tool_call>{{"name": "get_time", "arguments": {args}}}</tool_call>'
    assert run(parser_named("json_tools"), [text]) == [text]


def test_arguments_are_written_without_nan_for_every_syntax():
    text = '[TOOL_CALLS]get_time[ARGS]{"n": 1e400}'
    (call,) = run(parser_named("mistral"), [text])
    assert call.arguments == '{"n": 1e400}'


# -- a forced call closes an open thinking block first --------------------------------


def test_forced_call_grammar_closes_the_thinking_block(demo_model):
    from llguidance import LLMatcher

    from gmlx.engine.structured import llg_tokenizer
    from gmlx.engine.tools import forced_call_grammar

    tok = demo_model.tokenizer
    parser = tool_parser_for(tok)
    llt = llg_tokenizer(tok)

    def accepts(grammar, text: str) -> bool:
        matcher = LLMatcher(llt, grammar.text, log_level=0)
        ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    closing = forced_call_grammar(parser, tok, (T,), "</think>")
    assert accepts(closing, "\n</think>\n\n" + call) and accepts(closing, "</think>\n\n" + call)
    assert not accepts(closing, call)  # not inside the block
    plain = forced_call_grammar(parser, tok, (T,))
    assert accepts(plain, call) and not accepts(plain, "</think>\n\n" + call)


def test_forced_call_grammar_leaves_what_llguidance_lacks_unenforced(demo_model):
    """Claude Code's TaskCreate schema uses ``propertyNames``: the call is still forced."""
    from gmlx.engine.tools import forced_call_grammar

    meta = Tool("TaskCreate", parameters={"type": "object", "properties": {"metadata": {
        "type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}}})
    assert forced_call_grammar(tool_parser_for(demo_model.tokenizer), demo_model.tokenizer, (meta,))
