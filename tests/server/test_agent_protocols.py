"""What real coding agents send, through the real server and the official SDKs.

Each test here stands for something found by running an agent against ``gmlx serve``:
Claude Code's system turn inside ``messages``, Codex's stateless Responses loop
(reasoning, custom tool calls and outputs sent back, hosted tools), forced tool calls
on a thinking model, and Anthropic's usage convention, which agents track their
context by. ``strict`` serves the demo model's weights with a Qwen-3-like template:
it refuses a system message that is not first, always opens a ``<think>`` block
(unless ``enable_thinking`` is false, as Qwen 3's does) and shows an assistant
turn's ``reasoning_content``.
"""

from __future__ import annotations

import json
import logging

import pytest
from live_server import serve_with_template

from gmlx.engine.loading.demo import CHAT_TEMPLATE

STRICT_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}\n"
    + CHAT_TEMPLATE.replace(
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
        "{%- if message.reasoning_content %}{{- '\\n<think>\\n' + message.reasoning_content"
        " + '\\n</think>\\n' }}{%- endif %}\n"
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    ).replace(
        "{%- if enable_thinking is defined and enable_thinking %}",
        "{%- if enable_thinking is not defined or enable_thinking %}",
    )
)
assert STRICT_TEMPLATE.count("reasoning_content") == 2 and "is not defined or" in STRICT_TEMPLATE

WEATHER = {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def strict(tmp_path_factory, demo_model):
    """A server of ``strict`` (the demo weights, STRICT_TEMPLATE) and its tokenizer."""
    from gmlx import load_tokenizer

    live, folder = serve_with_template(tmp_path_factory.mktemp("strict"), demo_model.source, "strict",
                                       STRICT_TEMPLATE)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template == STRICT_TEMPLATE
    yield live, tokenizer
    live.stop()


def clients(live):
    import anthropic
    import openai

    return (openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", timeout=30, max_retries=0),
            anthropic.Anthropic(base_url=live.url, api_key="x", timeout=30, max_retries=0))


# -- 1. a system turn inside Anthropic messages (Claude Code's agent list) -----------------

AGENTS = "Available agents: general-purpose, Explore."
CLAUDE_CODE = [
    {"role": "user", "content": "Find the bug."},
    {"role": "system", "content": [{"type": "text", "text": AGENTS}]},
    {"role": "user", "content": "It is in main.py."},
]


def test_a_system_turn_renders_at_its_place(anthropic_client, demo_tokenizer):
    """The demo template takes a system message anywhere: it stays where it was sent."""
    counted = anthropic_client.messages.count_tokens(model="demo", system="Be brief.",
                                                     messages=CLAUDE_CODE)
    expected = demo_tokenizer.encode_chat([
        {"role": "system", "content": "Be brief."}, CLAUDE_CODE[0],
        {"role": "system", "content": AGENTS}, CLAUDE_CODE[2]])
    assert counted.input_tokens == len(expected)
    no_end = {"logit_bias": {str(t): -100 for t in demo_tokenizer.eos_token_ids}}  # sampled: may end early
    msg = anthropic_client.messages.create(model="demo", max_tokens=3, system="Be brief.",
                                           messages=[*CLAUDE_CODE[:1], {"role": "system", "content": AGENTS}],
                                           extra_body=no_end)
    assert msg.stop_reason == "max_tokens"


@pytest.mark.parametrize("turns, folded", [
    (CLAUDE_CODE, [CLAUDE_CODE[0], {"role": "user", "content": f"{AGENTS}\n\nIt is in main.py."}]),
    # Nothing follows: it joins the user turn before it.
    (CLAUDE_CODE[:2], [{"role": "user", "content": f"Find the bug.\n\n{AGENTS}"}]),
])
def test_a_template_that_refuses_it_gets_it_in_a_user_turn(strict, turns, folded):
    live, tokenizer = strict
    with pytest.raises(Exception, match="System message must be at the beginning"):
        tokenizer.render_chat([{"role": "system", "content": "Be brief."}, *turns[:1],
                               {"role": "system", "content": AGENTS}])
    _, anthropic_client = clients(live)
    counted = anthropic_client.messages.count_tokens(model="strict", system="Be brief.", messages=turns)
    expected = tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *folded])
    assert counted.input_tokens == len(expected)
    msg = anthropic_client.messages.create(model="strict", max_tokens=2, system="Be brief.",
                                           messages=turns, thinking={"type": "disabled"})
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(
        tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *folded],
                              enable_thinking=False))


def test_the_rule_is_the_engines_so_chat_has_it_too(strict):
    live, tokenizer = strict
    openai_client, _ = clients(live)
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "bye"}]
    r = openai_client.chat.completions.create(model="strict", messages=messages, max_tokens=1)
    folded = [messages[0], {"role": "user", "content": "Answer in French.\n\nbye"}]
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(folded))


# -- 2. Codex: Responses, store false, reasoning and custom tools sent back ---------------

PATCH_GRAMMAR = 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
HOSTED = [{"type": "web_search"}, {"type": "namespace", "name": "crm", "description": "CRM",
                                   "tools": [{"type": "function", "name": "lookup"}]}]
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
CODEX_TURN = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a.txt"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "I should add the file."}]},
    {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "apply_patch",
     "input": PATCH, "status": "completed"},
    {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done."},
    {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Check it."}]},
    {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "get_weather",
     "arguments": '{"city": "Oslo"}'},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "sunny"}]},
]


def test_codex_sends_back_reasoning_and_custom_tool_items(openai_client, caplog):
    tools = [{"type": "function", **WEATHER}, APPLY_PATCH, *HOSTED]
    with caplog.at_level(logging.WARNING, logger="gmlx.server"):
        r = openai_client.responses.create(model="demo", input=CODEX_TURN, tools=tools, store=False,
                                           max_output_tokens=3)
    assert r.status in ("completed", "incomplete")
    (line,) = [rec.getMessage() for rec in caplog.records if "ignored parameters" in rec.getMessage()]
    assert "tools (web_search, namespace crm)" in line and "store" in line


def test_the_items_render_as_the_turns_the_model_wrote(strict):
    """Reasoning rides on the assistant turn it began, a custom call is a call whose
    arguments are {"input": text}, and its output a tool result."""
    live, tokenizer = strict
    openai_client, _ = clients(live)
    r = openai_client.responses.create(model="strict", input=CODEX_TURN, store=False, max_output_tokens=1)
    expected = tokenizer.encode_chat([
        {"role": "user", "content": "Add a.txt"},
        {"role": "assistant", "content": "", "reasoning_content": "I should add the file.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "apply_patch", "arguments": json.dumps({"input": PATCH})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Done."},
        {"role": "assistant", "content": "", "reasoning_content": "Check it.",
         "tool_calls": [{"id": "call_2", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ])
    assert r.usage.input_tokens == len(expected)


def test_a_turn_of_text_reasoning_and_calls_is_one_assistant_message():
    from gmlx.server.openai.responses_input import input_messages

    messages = input_messages("Be brief.", [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "plan"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "b", "name": "g", "input": "free\ntext"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "dropped"}]},
        {"role": "user", "content": "next"},
    ])
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    turn = messages[2]
    assert (turn.content, turn.reasoning) == ("On it.", "plan")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("a", "f", {}), ("b", "g", {"input": "free\ntext"})]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_to_a_custom_tool_is_a_custom_tool_call(openai_client, stream):
    kwargs = {"model": "demo", "input": "Add a.txt", "max_output_tokens": 200, "temperature": 1.0,
              "tools": [APPLY_PATCH, {"type": "function", **WEATHER}],
              "tool_choice": {"type": "custom", "name": "apply_patch"}, "extra_body": {"seed": 4}}
    if stream:
        with openai_client.responses.stream(**kwargs) as events:
            kinds = [e.type for e in events]
            r = events.get_final_response()
        assert "response.custom_tool_call_input.delta" in kinds
        assert "response.custom_tool_call_input.done" in kinds
        assert "response.function_call_arguments.delta" not in kinds
    else:
        r = openai_client.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert isinstance(call.input, str) and call.call_id.startswith("call_")
    assert not call.input.startswith('{"input"')  # the free text itself, not the JSON around it


def test_a_custom_tool_is_offered_as_a_function_of_one_string():
    from gmlx.server.openai.responses_input import custom_input, dropped_tools, function_tools

    (fn,) = function_tools([APPLY_PATCH, *HOSTED])
    params = fn["function"]["parameters"]
    assert fn["function"]["name"] == "apply_patch" and params["required"] == ["input"]
    assert PATCH_GRAMMAR in params["properties"]["input"]["description"]
    assert dropped_tools([APPLY_PATCH, *HOSTED]) == ["web_search", "namespace crm"]
    assert custom_input('{"input": "x\\ny"}') == "x\ny"
    assert custom_input("not json") == "not json"


# -- 3. a forced call on a thinking model is a call, not reasoning ------------------------


def test_the_forced_grammar_closes_the_block_the_prompt_opened(server):
    """With thinking on, the demo template ends the prompt inside ``<think>``: the
    grammar writes ``</think>`` before the call (the pipeline would also find a call
    inside reasoning, so the HTTP tests below pass either way)."""
    from gmlx.engine.types import ChatRequest, Message, Reasoning, Tool, ToolChoice, ToolChoiceMode

    engine = server.app.state.engine

    def grammar(thinking: bool) -> str:
        job = engine.start_sync(ChatRequest(
            model="demo", messages=(Message.text("user", "hi"),), max_tokens=100,
            tools=(Tool("get_weather", parameters=WEATHER["parameters"]),),
            tool_choice=ToolChoice(ToolChoiceMode.REQUIRED), reasoning=Reasoning(enabled=thinking)))
        (call,) = [c for ev in job.handle for c in ev.tool_calls]
        assert call.name == "get_weather"
        return job.handle.request.grammar.text

    assert "</think>" in grammar(True)
    assert "</think>" not in grammar(False)


def test_forced_call_with_thinking_on_chat(openai_client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = openai_client.chat.completions.create(
            model="demo", messages=USER, tools=[{"type": "function", "function": WEATHER}],
            tool_choice=choice, max_tokens=200, temperature=1.0, seed=5,
            extra_body={"enable_thinking": True})
        choice_ = r.choices[0]
        assert choice_.finish_reason == "tool_calls"
        (call,) = choice_.message.tool_calls
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        assert not (choice_.message.model_extra or {}).get("reasoning_content")


def test_forced_call_with_thinking_on_responses(openai_client):
    kwargs = {"model": "demo", "input": "Weather?", "max_output_tokens": 200, "temperature": 1.0,
              "tools": [{"type": "function", **WEATHER}], "tool_choice": "required",
              "reasoning": {"effort": "low"}, "extra_body": {"seed": 6}}
    r = openai_client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["function_call"]
    with openai_client.responses.stream(**kwargs) as events:
        final = events.get_final_response()
    assert [o.type for o in final.output] == ["function_call"]


def test_forced_call_with_thinking_on_anthropic(anthropic_client):
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    kwargs = {"model": "demo", "max_tokens": 200, "messages": USER, "tools": [tool],
              "thinking": {"type": "enabled", "budget_tokens": 50},
              "extra_body": {"seed": 7, "temperature": 1.0}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = anthropic_client.messages.create(**kwargs, tool_choice=choice)
        assert msg.stop_reason == "tool_use"
        assert [b.type for b in msg.content] == ["tool_use"]
        with anthropic_client.messages.stream(**kwargs, tool_choice=choice) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["tool_use"]


def test_forced_call_on_a_template_that_always_thinks(strict):
    live, _ = strict
    openai_client, _ = clients(live)
    r = openai_client.chat.completions.create(
        model="strict", messages=USER, tools=[{"type": "function", "function": WEATHER}],
        tool_choice="required", max_tokens=200, temperature=1.0, seed=8)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


# -- 4. tool-call arguments are always JSON ---------------------------------------------


def test_anthropic_tool_use_input_is_json_whatever_the_number():
    """The engine keeps the model's ``1e999`` (valid JSON, beyond a double); the
    tool_use input writes it as the integer it is, never as Infinity."""
    from gmlx.engine.types import ToolCall
    from gmlx.server.anthropic.translate import tool_use

    block = tool_use(ToolCall("call_1", "f", '{"n": 1e999, "x": 0.5}'))
    text = json.dumps(block, allow_nan=False)  # what JSONResponse does: it would raise on inf
    assert json.loads(text)["input"] == {"n": 10**999, "x": 0.5}
    huge = tool_use(ToolCall("call_2", "f", '{"n": 1e99999}'))  # too many digits to write
    assert huge["input"] == {"input": '{"n": 1e99999}'}


# -- 5. Anthropic usage: input_tokens leave out what the prompt cache supplied -------------


def test_cached_turn_reports_input_and_cache_read_apart(anthropic_client):
    first_turn = [{"role": "user", "content": "Tell me about the fox that jumps over the dog."}]
    first = anthropic_client.messages.create(model="demo", max_tokens=4, messages=first_turn,
                                             extra_body={"temperature": 0})
    second_turn = [*first_turn, {"role": "assistant", "content": first.content[0].text},
                   {"role": "user", "content": "And the dog?"}]
    prompt = anthropic_client.messages.count_tokens(model="demo", messages=second_turn).input_tokens
    second = anthropic_client.messages.create(model="demo", max_tokens=4, messages=second_turn)
    usage = second.usage
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    assert usage.input_tokens < prompt and usage.cache_creation_input_tokens == 0

    third_turn = [*second_turn, {"role": "assistant", "content": second.content[0].text},
                  {"role": "user", "content": "Thanks."}]
    prompt = anthropic_client.messages.count_tokens(model="demo", messages=third_turn).input_tokens
    with anthropic_client.messages.stream(model="demo", max_tokens=4, messages=third_turn) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    # message_start goes out before the cache lookup: the whole prompt, as input.
    assert start.message.usage.input_tokens == prompt
    assert delta.usage.cache_read_input_tokens > 0
    assert delta.usage.input_tokens + delta.usage.cache_read_input_tokens == prompt
    assert final.usage.input_tokens == delta.usage.input_tokens
    assert final.usage.cache_read_input_tokens == delta.usage.cache_read_input_tokens


# -- structured output on a thinking model is the answer, not reasoning --------------------

VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_with_thinking_on_is_the_answer(openai_client, stream):
    """With thinking on, the demo template ends the prompt inside ``<think>``; the
    response format's grammar closes the block first, so the JSON comes back as the
    content (before, it was written inside the block and came back as reasoning)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    kwargs = {"model": "demo", "messages": USER, "response_format": fmt, "max_tokens": 40,
                  "temperature": 1.0, "seed": 3, "extra_body": {"enable_thinking": True}}
    if stream:
        content, reasoning = "", ""
        for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
    else:
        message = openai_client.chat.completions.create(**kwargs).choices[0].message
        content = message.content or ""
        reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    assert json.loads(content) in ({"ok": True}, {"ok": False})
    assert not reasoning.strip()


def test_the_format_grammar_closes_the_block_only_when_open(server):
    from gmlx.engine.types import ChatRequest, Message, Reasoning, ResponseFormat

    engine = server.app.state.engine

    def grammar(thinking: bool) -> str:
        job = engine.start_sync(ChatRequest(
            model="demo", messages=(Message.text("user", "hi"),), max_tokens=40,
            response_format=ResponseFormat("json_schema", VERDICT), reasoning=Reasoning(enabled=thinking)))
        list(job.handle)
        return job.handle.request.grammar.text

    assert "</think>" in grammar(True)
    assert "</think>" not in grammar(False)
