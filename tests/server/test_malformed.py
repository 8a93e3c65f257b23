"""Malformed bodies: every one is a typed 4xx in the route's protocol shape, never a
500, FastAPI's 422 or a hang.

Each case is sent raw to the live server. A case that the server accepted would
generate, so every body that could validate pins ``max_tokens`` low: a regression
shows up as a fast 200, not a slow test.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from live_server import protocol_error

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}

CHAT = {"model": "demo", "messages": HI, "max_tokens": 2}
COMPLETION = {"model": "demo", "prompt": "hi", "max_tokens": 2}
RESPONSES = {"model": "demo", "input": "hi", "max_output_tokens": 2}
MESSAGES = {"model": "demo", "messages": HI, "max_tokens": 2}


class Raw:
    """A body sent byte for byte (not valid JSON, or JSON that ``json.dumps`` cannot spell)."""

    def __init__(self, data: bytes | str) -> None:
        self.data = data.encode() if isinstance(data, str) else data

    def __repr__(self) -> str:
        return f"Raw({self.data[:40]!r})"


def over(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**base, **fields}


def without(base: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != key}


def raw_with(base: dict[str, Any], field: str, literal: str) -> Raw:
    """``base`` with ``field`` set to a JSON literal (``NaN``, ``1e309``)."""
    return Raw(json.dumps(base)[:-1] + f', "{field}": {literal}}}')


CHAT_CASES: list[Any] = [
    Raw(b"{not json"),
    Raw(b'{"model": "demo", "messages": [{"role": "user", "content": "hi"'),  # truncated
    Raw(b'{"model": "demo", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    Raw(b"\xff\xfe\x00\x01"),
    Raw(b""),
    [CHAT],
    "a string",
    None,
    42,
    without(CHAT, "messages"),
    over(CHAT, messages=[]),
    over(CHAT, messages="hi"),
    over(CHAT, messages={"role": "user", "content": "hi"}),
    over(CHAT, messages=[1, 2]),
    over(CHAT, messages=[{"content": "hi"}]),
    over(CHAT, messages=[{"role": "wizard", "content": "hi"}]),
    over(CHAT, messages=[{"role": 5, "content": "hi"}]),
    over(CHAT, messages=[{"role": "user", "content": 5}]),
    over(CHAT, messages=[{"role": "user", "content": {"text": "hi"}}]),
    over(CHAT, messages=[{"role": "user", "content": [{"text": "hi"}]}]),
    over(CHAT, messages=[{"role": "user", "content": [5]}]),
    over(CHAT, messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
    over(CHAT, model=5),
    over(CHAT, model=["demo"]),
    over(CHAT, profile=7),
    over(CHAT, max_tokens=0),
    over(CHAT, max_tokens=-5),
    over(CHAT, max_tokens="ten"),
    over(CHAT, max_tokens="10"),
    over(CHAT, max_tokens=2.5),
    over(CHAT, max_tokens=10**40),
    raw_with(without(CHAT, "max_tokens"), "max_tokens", "1e309"),
    over(CHAT, max_completion_tokens=0),
    over(CHAT, temperature="hot"),
    over(CHAT, temperature="0.5"),
    raw_with(CHAT, "temperature", "NaN"),
    raw_with(CHAT, "temperature", "Infinity"),
    raw_with(CHAT, "temperature", "1e309"),
    over(CHAT, temperature=-1),
    over(CHAT, top_p=0),
    over(CHAT, top_k=-1),
    over(CHAT, top_k=10**40),
    over(CHAT, seed=10**40),
    over(CHAT, seed="abc"),
    over(CHAT, repetition_context_size=10**40),
    over(CHAT, thinking_budget=-1),
    over(CHAT, stream="maybe"),
    over(CHAT, stream="true"),
    over(CHAT, stream=1),
    over(CHAT, stream_options="usage"),
    over(CHAT, stream_options={"include_usage": "yes"}),
    over(CHAT, stop=5),
    over(CHAT, stop=[1, 2]),
    over(CHAT, logit_bias={"abc": 1}),
    over(CHAT, logit_bias={"1": "x"}),
    over(CHAT, logit_bias={"1": 1000}),
    over(CHAT, logit_bias={"99999999": 1}),
    over(CHAT, logit_bias=[1, 2]),
    over(CHAT, logprobs="yes"),
    over(CHAT, logprobs=True, top_logprobs=50),
    over(CHAT, top_logprobs=-1),
    over(CHAT, response_format={"type": "xml"}),
    over(CHAT, response_format={"type": "json_schema", "json_schema": {"schema": "object"}}),
    over(CHAT, response_format={"type": "json_schema", "json_schema": 5}),
    over(CHAT, response_format="json"),
    over(CHAT, tools="get_weather"),
    over(CHAT, tools=[5]),
    over(CHAT, tools=[{"type": "function"}]),
    over(CHAT, tools=[{"type": "function", "function": {"parameters": {}}}]),
    over(CHAT, tools=[{"type": "function", "function": {"name": 5}}]),
    over(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
    over(CHAT, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
    over(CHAT, tools=[TOOL], tool_choice="sometimes"),
    over(CHAT, tool_choice="required"),
    over(CHAT, tool_choice=5),
    over(CHAT, chat_template_kwargs="x"),
    over(CHAT, enable_thinking="sure"),
    over(CHAT, reasoning_effort=5),
]

COMPLETION_CASES: list[Any] = [
    Raw(b"{"),
    [],
    without(COMPLETION, "prompt"),
    over(COMPLETION, prompt={"text": "hi"}),
    over(COMPLETION, prompt=5),
    over(COMPLETION, prompt=None),
    over(COMPLETION, prompt=[1, 2, 3]),
    over(COMPLETION, prompt=[]),
    over(COMPLETION, prompt=["a", "b"]),
    over(COMPLETION, n=0),
    over(COMPLETION, n=2),
    over(COMPLETION, n="one"),
    over(COMPLETION, best_of=3),
    over(COMPLETION, echo=True),
    over(COMPLETION, suffix=5),
    over(COMPLETION, max_tokens=-1),
    over(COMPLETION, max_tokens="2"),
    over(COMPLETION, stop={"a": 1}),
    over(COMPLETION, stream="no"),
]

RESPONSES_CASES: list[Any] = [
    Raw(b"[1,"),
    "input",
    without(RESPONSES, "input"),
    over(RESPONSES, input=5),
    over(RESPONSES, input=None),
    over(RESPONSES, input={"role": "user", "content": "hi"}),
    over(RESPONSES, input=[5]),
    over(RESPONSES, input=["hi"]),
    over(RESPONSES, input=[{"type": "message", "role": "user", "content": 5}]),
    over(RESPONSES, input=[{"type": "message", "role": "user", "content": {"a": 1}}]),
    over(RESPONSES, input=[{"type": "message", "role": "wizard", "content": "hi"}]),
    over(RESPONSES, input=[{"type": "message", "role": "user", "content": [{"text": "x"}]}]),
    over(RESPONSES, input=[{"type": "telepathy"}]),
    over(RESPONSES, instructions=5),
    over(RESPONSES, max_output_tokens=0),
    over(RESPONSES, max_output_tokens="many"),
    over(RESPONSES, text={"format": {"type": "xml"}}),
    over(RESPONSES, text={"format": {"type": "json_schema", "schema": []}}),
    over(RESPONSES, text="json"),
    over(RESPONSES, tools=[{"type": "function"}]),
    over(
        RESPONSES,
        tools=[{"type": "function", "name": "f"}],
        tool_choice={"type": "function", "name": "g"},
    ),
    over(RESPONSES, reasoning="high"),
]

MESSAGES_CASES: list[Any] = [
    Raw(b'{"model": "demo", "messages": ['),
    Raw(b"\x80\x81"),
    [MESSAGES],
    None,
    without(MESSAGES, "messages"),
    over(MESSAGES, messages=[]),
    over(MESSAGES, messages="hi"),
    over(MESSAGES, messages=[{"role": "tool", "content": "hi"}]),  # system is a role here
    over(MESSAGES, messages=[{"role": "system", "content": [{"type": "image"}]}]),
    over(MESSAGES, messages=[{"role": "user"}]),
    over(MESSAGES, messages=[{"role": "user", "content": 5}]),
    over(MESSAGES, messages=[{"role": "user", "content": [5]}]),
    over(MESSAGES, messages=[{"role": "user", "content": [{"text": "hi"}]}]),
    over(MESSAGES, messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
    over(MESSAGES, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    over(
        MESSAGES,
        messages=[{"role": "user", "content": [{"type": "tool_result", "content": 5}]}],
    ),
    over(MESSAGES, system=5),
    over(MESSAGES, system=[5]),
    over(MESSAGES, system=[{"type": "image"}]),
    over(MESSAGES, max_tokens=0),
    over(MESSAGES, max_tokens="lots"),
    over(MESSAGES, max_tokens=10**40),
    over(MESSAGES, stop_sequences="END"),
    over(MESSAGES, temperature="warm"),
    raw_with(MESSAGES, "temperature", "NaN"),
    over(MESSAGES, stream="yes"),
    over(MESSAGES, tools=[{"description": "no name"}]),
    over(MESSAGES, tools=[{"name": "f", "input_schema": "x"}]),
    over(MESSAGES, tools="f"),
    over(MESSAGES, tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "nope"}),
    over(MESSAGES, tool_choice="auto"),
    over(MESSAGES, thinking="on"),
    over(MESSAGES, output_config={"format": {"type": "xml"}}),
    over(MESSAGES, output_config={"format": {"type": "json_schema", "schema": 5}}),
    over(MESSAGES, metadata="x", top_k="k"),
]

COUNT_TOKENS_CASES: list[Any] = [
    Raw(b"nope"),
    "count me",
    without(MESSAGES, "messages"),
    over(MESSAGES, messages=[{"role": "user", "content": {"x": 1}}]),
    over(MESSAGES, system={"text": "x"}),
    over(MESSAGES, messages=[{"role": "user", "content": [{"type": "warp"}]}]),
    over(MESSAGES, tools=[{"input_schema": {}}]),
]

ESTIMATE_CASES: list[Any] = [
    Raw(b"{"),
    [1, 2],
    without(CHAT, "messages"),
    over(CHAT, max_tokens=-5),
    over(CHAT, max_tokens="ten"),
    over(CHAT, messages=[{"role": "user", "content": 5}]),
    over(CHAT, messages=[{"role": "wizard", "content": "hi"}]),
    over(CHAT, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
    over(CHAT, model="Qwen/Qwen2.5-7B"),
]

CACHE_RESET_CASES: list[Any] = [
    Raw(b"{"),
    Raw(b"\xff"),
    [1],
    "demo",
    {"model": 5},
    {"model": ["demo"]},
    {"model": "nope"},
]

CASES: list[tuple[str, Any]] = [
    *(("/v1/chat/completions", b) for b in CHAT_CASES),
    *(("/v1/completions", b) for b in COMPLETION_CASES),
    *(("/v1/responses", b) for b in RESPONSES_CASES),
    *(("/v1/messages", b) for b in MESSAGES_CASES),
    *(("/v1/messages/count_tokens", b) for b in COUNT_TOKENS_CASES),
    *(("/v1/estimate", b) for b in ESTIMATE_CASES),
    *(("/v1/cache/reset", b) for b in CACHE_RESET_CASES),
    *(("/v1/chat/completions", over(b, dry_run=True)) for b in ESTIMATE_CASES[2:]),
]


def encode(body: Any) -> bytes:
    if isinstance(body, Raw):
        return body.data
    return json.dumps(body).encode()


def assert_typed_4xx(r: httpx.Response, path: str) -> dict[str, Any]:
    """A 4xx other than 422, with the route's protocol error shape; returns the inner error."""
    assert 400 <= r.status_code < 500 and r.status_code != 422, (r.status_code, r.text)
    body = r.json()
    err = protocol_error(body, path, body)
    assert err["message"] and "Internal error" not in err["message"]
    return err


def test_there_are_enough_cases():
    assert len(CASES) >= 50


def case_id(path: str, body: Any) -> str:
    """A readable test id: the route and the body (what differs from the route's base)."""
    base = {"/v1/completions": COMPLETION, "/v1/responses": RESPONSES}.get(
        path, MESSAGES if path.startswith("/v1/messages") else CHAT
    )
    if isinstance(body, dict):
        shown: Any = {k: v for k, v in body.items() if base.get(k, ...) != v}
        shown.update({f"-{k}": None for k in base if k not in body})
    else:
        shown = body
    return f"{path.removeprefix('/v1/')}:{str(shown)[:70]}"


@pytest.mark.parametrize(("path", "body"), CASES, ids=[case_id(p, b) for p, b in CASES])
def test_malformed_body_is_a_typed_4xx(http, path, body):
    r = http.post(
        path,
        content=encode(body),
        headers={"content-type": "application/json"},
        timeout=10,  # a hang fails here, not at the session timeout
    )
    assert_typed_4xx(r, path)


@pytest.mark.parametrize("stream", [False, True])
def test_errors_come_before_a_stream_starts(http, stream):
    r = http.post("/v1/messages", json=over(MESSAGES, max_tokens=0, stream=stream), timeout=10)
    assert_typed_4xx(r, "/v1/messages")
    assert not r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(
    "request_id", ["nope", "req-" + "x" * 2000, "chatcmpl-", "%E2%98%83", "a b", "req-%00"]
)
def test_cancel_of_an_unknown_request_is_404(http, request_id):
    r = http.post(f"/v1/requests/{request_id}/cancel", content=b"{garbage", timeout=10)
    err = assert_typed_4xx(r, "/v1/requests")
    assert r.status_code == 404 and err["code"] == "request_not_found"


def test_query_validation_is_400_not_422(http):
    r = http.get("/v1/capacity/plan", params={"width": "wide", "depth": -1}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"]


def test_a_repo_id_is_not_a_model(server, http):
    """A request naming an unconfigured Hugging Face repo id is a 404 and loads nothing."""
    registry = server.app.state.registry
    before = {id(w) for w in registry.workers()}
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)):
        r = http.post(path, json=over(base, model="Qwen/Qwen2.5-7B"), timeout=10)
        assert r.status_code == 404, r.text
        err = assert_typed_4xx(r, path)
        if path == "/v1/messages":
            assert err["type"] == "not_found_error"
        else:
            assert err["type"] == "model_not_found" and err["code"] == "model_not_found"
    assert {id(w) for w in registry.workers()} == before


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 10**6},  # more than the vocabulary: keeps every token
        {"seed": -1},  # OpenAI seeds are signed
        {"seed": 2**64 - 1},
        {"max_tokens": 1, "temperature": 0},
        {"temperature": 1, "top_p": 1.0},  # ints where floats are declared
    ],
)
def test_edge_values_that_are_valid_still_generate(http, fields):
    r = http.post("/v1/chat/completions", json=over(CHAT, **fields), timeout=10)
    assert r.status_code == 200, r.text
