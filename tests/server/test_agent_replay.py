"""Replay the request bodies real coding agents sent to a gmlx server (tests/fixtures/agents).

Each captured body goes to the test server through the official SDK call its path maps onto
(Anthropic ``beta.messages`` for Claude Code's ``/v1/messages?beta=true``, OpenAI
``responses`` for Codex, OpenAI ``chat.completions`` for pi and opencode), streamed when the
agent streamed. The agents' prompts are far longer than the demo model's 8192-token window,
so every body is trimmed first: long texts are cut and tool schemas lose their prose, while
the structure (tools, roles, item and block types, the agent's own extra fields) stays as
sent. Then one test per agent shape forces a tool call in that agent's request shape, with
its whole tool list, and checks the streamed answer carries a parsed call.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
CAPTURES = sorted(p.stem for p in FIXTURES.glob("*-[0-9].json"))

TEXT_LIMIT = 80  # characters kept of any long prose string
# Strings that are data, not prose: cut, they would no longer parse or mean the same.
VERBATIM = {"arguments", "input", "definition", "pattern", "partial_json", "type", "role",
            "name", "call_id", "id", "tool_use_id", "tool_call_id", "model"}
# Headers the SDKs set themselves.
SDK_HEADERS = ("user-agent", "content-type", "accept", "content-length", "x-stainless-")
MAX_TOKENS = 8  # a replay's output cap
FORCED_MAX_TOKENS = 400  # room for a forced call's arguments


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _schema(node):
    """A JSON schema without its prose (descriptions, titles, ``$schema``)."""
    if isinstance(node, list):
        return [_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("description", "title", "$schema") and isinstance(value, str):
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _schema(prop) for name, prop in value.items()}
        else:
            out[key] = _schema(value)
    return out


def trim(node, key: str | None = None):
    """The body with long prose cut to TEXT_LIMIT and tool schemas without prose."""
    if isinstance(node, str):
        return node if key in VERBATIM or len(node) <= TEXT_LIMIT else node[:TEXT_LIMIT]
    if isinstance(node, list):
        return [trim(x, key) for x in node]
    if isinstance(node, dict):
        return {k: _schema(v) if k in ("input_schema", "parameters") else trim(v, k)
                for k, v in node.items()}
    return node


def _cap(body: dict, limit: int) -> dict:
    """``body`` with its output cap at ``limit``, under the agent's own key (or the protocol's)."""
    body = dict(body)
    keys = [k for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in body]
    if not keys:
        keys = ["max_output_tokens"]  # only Codex sends none, on the Responses route
    for k in keys:
        body[k] = limit
    return body


def _headers(fixture: dict) -> dict:
    return {k: v for k, v in fixture["headers"].items() if not k.lower().startswith(SDK_HEADERS)}


def _call(method, body: dict, headers: dict):
    """``method(**body)``: the fields its signature names as arguments, the rest as extra_body."""
    params = inspect.signature(method).parameters
    kwargs = {k: v for k, v in body.items() if k in params}
    extra = {k: v for k, v in body.items() if k not in params}
    return method(**kwargs, extra_body=extra or None, extra_headers=headers or None)


def send(fixture: dict, body: dict, openai_client, anthropic_client):
    """Send ``body`` where the agent sent it, through the SDK; a stream's events as a list."""
    path, headers = fixture["path"], _headers(fixture)
    if path == "/v1/messages":
        if "beta=true" in fixture["query"]:
            method = anthropic_client.beta.messages.create
            headers.pop("anthropic-beta", None)
            betas = fixture["headers"].get("anthropic-beta", "")
            body = {**body, "betas": [b for b in betas.split(",") if b]}
        else:
            method = anthropic_client.messages.create
    elif path == "/v1/responses":
        method = openai_client.responses.create
    elif path == "/v1/chat/completions":
        method = openai_client.chat.completions.create
    else:
        raise AssertionError(f"no SDK call for {path}")
    answer = _call(method, body, headers)
    return list(answer) if body.get("stream") else answer


def _dump(x) -> dict:
    return x.model_dump() if hasattr(x, "model_dump") else x


# -- the shape of an answer in each protocol -------------------------------------------


def check_anthropic_stream(events: list) -> list[dict]:
    """Asserts a well-formed Messages stream; returns its content blocks as the client builds them."""
    events = [_dump(e) for e in events]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert events[0]["message"]["role"] == "assistant"
    blocks: dict[int, dict] = {}
    open_blocks: set[int] = set()
    stop_reason = None
    for e in events[1:-1]:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = {**e["content_block"], "partial_json": ""}
            open_blocks.add(e["index"])
        elif e["type"] == "content_block_delta":
            assert e["index"] in open_blocks
            delta, block = e["delta"], blocks[e["index"]]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif delta["type"] == "input_json_delta":
                block["partial_json"] += delta["partial_json"]
        elif e["type"] == "content_block_stop":
            open_blocks.remove(e["index"])
        elif e["type"] == "message_delta":
            stop_reason = e["delta"]["stop_reason"]
    assert not open_blocks
    assert stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence"), stop_reason
    assert all(b["type"] in ("text", "thinking", "redacted_thinking", "tool_use") for b in blocks.values())
    return [blocks[i] for i in sorted(blocks)]


def check_responses_stream(events: list) -> dict:
    """Asserts a well-formed Responses stream; returns the final response."""
    events = [_dump(e) for e in events]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    final = events[-1]["response"]
    assert final["status"] in ("completed", "incomplete")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in final["output"]] == [i["type"] for i in done]
    assert all(i["type"] in ("message", "reasoning", "function_call") for i in done)
    return final


def check_chat_stream(chunks: list, body: dict) -> tuple[str, dict[int, dict]]:
    """Asserts a well-formed chat stream; returns its finish reason and its tool calls by index."""
    chunks = [_dump(c) for c in chunks]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finish, calls = None, {}
    for c in chunks:
        for choice in c["choices"]:
            finish = choice["finish_reason"] or finish
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                fn = call.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
    assert finish in ("stop", "length", "tool_calls"), finish
    if (body.get("stream_options") or {}).get("include_usage"):
        assert chunks[-1]["usage"]["completion_tokens"] >= 1
    return finish, calls


def check(fixture: dict, body: dict, answer) -> None:
    path = fixture["path"]
    if not body.get("stream"):
        answer = _dump(answer)
        if path == "/v1/messages":
            assert answer["type"] == "message" and answer["role"] == "assistant"
        elif path == "/v1/responses":
            assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
        else:
            assert answer["object"] == "chat.completion" and answer["choices"]
        return
    if path == "/v1/messages":
        check_anthropic_stream(answer)
    elif path == "/v1/responses":
        check_responses_stream(answer)
    else:
        check_chat_stream(answer, body)


# -- the fixtures themselves ----------------------------------------------------------------


def test_every_agent_is_captured():
    agents = {load(name)["agent"] for name in CAPTURES}
    assert agents == {"claude-code", "codex", "pi", "opencode"}
    for name in CAPTURES:
        fixture = load(name)
        assert fixture["source"] in ("captured", "hand-written") and fixture["version"]
        assert fixture["body"]["model"] == "demo"
        assert not {"authorization", "x-api-key"} & {h.lower() for h in fixture["headers"]}


def test_trimmed_bodies_keep_their_structure():
    def shape(node):
        if isinstance(node, dict):
            return {k: shape(v) for k, v in node.items()
                    if not (k in ("description", "title", "$schema") and isinstance(v, str))}
        if isinstance(node, list):
            return [shape(x) for x in node]
        return type(node).__name__

    for name in CAPTURES:
        body = load(name)["body"]
        assert shape(trim(body)) == shape(body), name


# -- replays ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CAPTURES)
def test_replay(name, openai_client, anthropic_client):
    fixture = load(name)
    body = _cap(trim(fixture["body"]), MAX_TOKENS)
    answer = send(fixture, body, openai_client, anthropic_client)
    check(fixture, body, answer)


@pytest.mark.parametrize("name", CAPTURES)
def test_untrimmed_body_is_refused_only_for_its_length(name, http):
    """The whole body, as the agent sent it (output capped): answered when it fits the demo's
    window, else refused for its length alone, never for a field the trim would have cut."""
    fixture = load(name)
    body = _cap(fixture["body"], MAX_TOKENS)
    url = fixture["path"] + (f"?{fixture['query']}" if fixture["query"] else "")
    with http.stream("POST", url, json=body, headers=_headers(fixture)) as r:
        r.read()
    if r.status_code == 200:
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if fixture["path"] == "/v1/messages":
        assert error["type"] == "invalid_request_error" and "prompt is too long" in error["message"], error
    else:
        assert error["code"] == "context_length_exceeded", error


# -- a forced tool call in each agent's shape -------------------------------------------------


def _function_names(tools: list[dict]) -> set[str]:
    names = set()
    for tool in tools:
        if tool.get("type") == "namespace":
            names |= _function_names(tool.get("tools") or [])
        name = tool.get("name") or (tool.get("function") or {}).get("name")
        if name:
            names.add(name)
    return names


@pytest.fixture(scope="module")
def quote_bias(demo_tokenizer) -> dict[str, float]:
    """A bias towards the tokens that close a JSON string: the random demo model, held to a
    call's grammar, would otherwise write its string arguments past any output cap."""
    ids = {t for text in ('"', '"}') for t in demo_tokenizer.encode(text, add_special_tokens=False)}
    return {str(t): 10 for t in ids}


def _forced(name: str, tool_choice, bias: dict) -> tuple[dict, dict]:
    """The agent's first body, trimmed, with a forced tool call in its own tool_choice shape."""
    fixture = load(name)
    body = _cap(trim(fixture["body"]), FORCED_MAX_TOKENS)
    body.update(tool_choice=tool_choice, stream=True, temperature=1.0, seed=1, logit_bias=bias)
    return fixture, body


def test_claude_code_forced_tool_use(openai_client, anthropic_client, quote_bias):
    fixture, body = _forced("claude-code-1", {"type": "any"}, quote_bias)
    blocks = check_anthropic_stream(send(fixture, body, openai_client, anthropic_client))
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert uses, f"no tool_use block in {[b['type'] for b in blocks]}"
    assert uses[0]["name"] in _function_names(body["tools"])
    assert uses[0]["id"]
    assert isinstance(json.loads(uses[0]["partial_json"] or "{}"), dict)


def test_codex_forced_function_call(openai_client, anthropic_client, quote_bias):
    fixture, body = _forced("codex-1", "required", quote_bias)
    final = check_responses_stream(send(fixture, body, openai_client, anthropic_client))
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert calls, f"no function_call item in {[i['type'] for i in final['output']]}"
    assert calls[0]["name"] in _function_names(body["tools"]) and calls[0]["call_id"]
    assert isinstance(json.loads(calls[0]["arguments"]), dict)


@pytest.mark.parametrize("name", ["pi-1", "opencode-1"])
def test_chat_agent_forced_tool_call(name, openai_client, anthropic_client, quote_bias):
    fixture, body = _forced(name, "required", quote_bias)
    finish, calls = check_chat_stream(send(fixture, body, openai_client, anthropic_client), body)
    assert finish == "tool_calls" and calls, f"finish {finish!r}, no tool_calls deltas"
    call = calls[0]
    assert call["id"] and call["name"] in _function_names(body["tools"])
    assert isinstance(json.loads(call["arguments"]), dict)
