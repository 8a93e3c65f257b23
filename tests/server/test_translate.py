"""The protocols' request fields as engine values: structured-output formats, tools and
tool_choice, reasoning controls. Each is translated as its route translates it and,
for formats, compiled by the engine."""

from __future__ import annotations

import json

import pytest

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.structured import Grammar, compile_format
from gmlx.engine.tools import select_tools, template_tools
from gmlx.server.anthropic import translate as anthropic
from gmlx.server.openai import translate as openai


def compile_response_format(fmt):
    """OpenAI's ``response_format`` through its translation and the engine's compiler."""
    return compile_format(openai.response_format(fmt))


def compile_output_config(config):
    """Anthropic's ``output_config`` through its translation and the engine's compiler."""
    return compile_format(anthropic.output_config(config))


PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
STEPS = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "integer"}}}}


# -- compiling ----------------------------------------------------------------------


def test_text_and_absent_formats_are_unconstrained():
    assert compile_response_format(None) is None
    assert compile_response_format({"type": "text"}) is None
    assert compile_output_config(None) is None
    assert compile_output_config({"effort": "low"}) is None


def test_json_schema_compiles_with_its_name():
    grammar = compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    )
    assert isinstance(grammar, Grammar)
    assert (grammar.kind, grammar.name) == ("json_schema", "person")
    assert json.loads(grammar.text)["grammars"]  # llguidance's serialized grammar


def test_output_config_json_schema_compiles():
    grammar = compile_output_config({"format": {"type": "json_schema", "schema": STEPS}})
    assert grammar is not None and grammar.kind == "json_schema"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x"}},  # no schema
        {"type": "json_schema"},  # no json_schema at all
        {"type": "json_schema", "json_schema": "not an object"},
        {"type": "json_schema", "json_schema": {"schema": ["not", "an", "object"]}},
        {"type": "json_schema", "json_schema": {"schema": "string"}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 5}}},
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/definitions/missing"}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}},
        {"type": "xml"},  # unknown type
        {},  # no type
        "json_object",  # not an object
    ],
)
def test_malformed_response_format_is_rejected(response_format):
    with pytest.raises(InvalidRequestError) as info:
        compile_response_format(response_format)
    assert info.value.param == "response_format"
    assert info.value.status == 400
    assert str(info.value)


def test_unknown_type_message_names_the_accepted_types():
    with pytest.raises(InvalidRequestError, match="json_schema"):
        compile_response_format({"type": "regex"})


@pytest.mark.parametrize(
    "output_config",
    [
        {"format": {"type": "text"}},
        {"format": {"type": "json_schema"}},
        {"format": {"type": "json_schema", "schema": {"type": "nope"}}},
        {"format": "json"},
    ],
)
def test_malformed_output_config_is_rejected(output_config):
    with pytest.raises(InvalidRequestError) as info:
        compile_output_config(output_config)
    assert info.value.param == "output_config"


def test_unimplemented_keywords_are_tolerated():
    # uniqueItems is not enforced by llguidance; the schema still constrains the shape.
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert compile_response_format({"type": "json_schema", "json_schema": {"schema": schema}})




# -- tools and tool_choice ------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]


def apply_tool_choice(tools, choice, protocol=openai):
    """A body's tools and tool_choice as the template sees them, and whether a call is
    forced: translated by ``protocol``, then selected by the engine."""
    selected, forced = select_tools(protocol.tools(tools), protocol.tool_choice(choice))
    return template_tools(selected), forced


@pytest.mark.parametrize("choice", [None, "auto", {"type": "auto"}])
def test_auto_keeps_the_tools(choice):
    assert apply_tool_choice(TOOLS, choice) == (TOOLS, False)
    anthropic_tools = [{"name": "get_time"}]
    assert apply_tool_choice(anthropic_tools, {"type": "auto"} if choice else None, anthropic) == (
        [{"type": "function", "function": {"name": "get_time", "description": "", "parameters": {}}}],
        False)


@pytest.mark.parametrize("choice, protocol", [("none", openai), ({"type": "none"}, anthropic)])
def test_none_strips_the_tools(choice, protocol):
    tools = TOOLS if protocol is openai else [{"name": "get_time"}]
    assert apply_tool_choice(tools, choice, protocol) == (None, False)


@pytest.mark.parametrize("choice, protocol", [("required", openai), ({"type": "any"}, anthropic)])
def test_required_keeps_the_tools_and_forces(choice, protocol):
    tools = TOOLS if protocol is openai else [{"name": "get_time", "input_schema": {"type": "object"}}]
    selected, forced = apply_tool_choice(tools, choice, protocol)
    assert forced and [t["function"]["name"] for t in selected] == (
        ["get_weather", "get_time"] if protocol is openai else ["get_time"])


def test_named_choice_keeps_only_that_tool():
    choice = {"type": "function", "function": {"name": "get_time"}}
    assert apply_tool_choice(TOOLS, choice) == ([TIME], True)
    anthropic_tools = [{"name": "get_time", "input_schema": {"type": "object"}},
                       {"name": "get_weather", "input_schema": {"type": "object"}}]
    assert apply_tool_choice(anthropic_tools, {"type": "tool", "name": "get_weather"}, anthropic) == (
        [{"type": "function", "function": {"name": "get_weather", "description": "",
                                           "parameters": {"type": "object"}}}], True)


def test_no_tools_auto_is_fine():
    assert apply_tool_choice(None, "auto") == (None, False)
    assert apply_tool_choice([], None) == (None, False)


@pytest.mark.parametrize("tools, choice", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}),
    (TOOLS, {"type": "function"}),
    (TOOLS, "sometimes"),
    (TOOLS, {"type": "maybe"}),
    (None, "required"),
])
def test_bad_tool_choice_is_rejected(tools, choice):
    with pytest.raises(InvalidRequestError) as info:
        apply_tool_choice(tools, choice)
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize("tools", [
    [{"type": "retrieval"}],
    [{"type": "function", "function": {"description": "no name"}}],
    [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
    ["not an object"],
])
def test_bad_tools_are_rejected(tools):
    with pytest.raises(InvalidRequestError) as info:
        apply_tool_choice(tools, None)
    assert info.value.param == "tools"


# -- reasoning controls -------------------------------------------------------------


def test_responses_reasoning_effort_is_the_engine_effort():
    from gmlx.server.openai.responses import responses_request
    from gmlx.server.openai.schemas import ResponsesRequest

    req = responses_request(ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "low"}}))
    assert req.reasoning.effort == "low"


def test_anthropic_thinking_maps_onto_the_reasoning_controls():
    from gmlx.server.anthropic.schemas import MessagesRequest

    def reasoning(**fields):
        body = MessagesRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
        return anthropic.messages_request(body).reasoning

    on = reasoning(thinking={"type": "enabled", "budget_tokens": 64})
    assert (on.enabled, on.budget) == (True, 64)
    assert reasoning(thinking={"type": "disabled"}).enabled is False
    explicit = reasoning(thinking={"type": "enabled", "budget_tokens": 64}, thinking_budget=8,
                         enable_thinking=False)
    assert (explicit.enabled, explicit.budget) == (False, 8)  # explicit fields win
