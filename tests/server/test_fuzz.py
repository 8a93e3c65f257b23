"""Property-based fuzzing of every route against a real server.

Two sources of bodies: schemathesis, from the app's own OpenAPI document (valid and
invalid data for every operation, its query and path parameters), and hypothesis
mutations of valid protocol bodies (a field dropped, replaced by any JSON value, an
unknown field added, the JSON truncated or replaced by bytes). Every answer must be a
2xx or a typed 4xx in the route's protocol shape, never a 500, a 422 or a hang (each
call has a timeout), and the server must answer ``/health`` after each run.

Bounded for CI (``GMLX_FUZZ_EXAMPLES``, default 25 per route and source); set it higher
for a longer run. Generation stays cheap: the demo model with a small window, and
output caps clamped to a few tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from live_server import LiveServer, protocol_error, serve_config

EXAMPLES = int(os.environ.get("GMLX_FUZZ_EXAMPLES", "25"))
# CI runs the same examples every time; a longer run (the variable set) explores anew.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize="GMLX_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=list(HealthCheck))

CONFIG = """\
server:
  decode_batch: 4
  max_body_bytes: 262144
models:
  demo:
    source: demo
    max_kv_size: 256
    default: true
profiles:
  short:
    max_tokens: 3
"""
CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = serve_config(tmp_path_factory.mktemp("fuzz"), CONFIG)
    yield live
    live.stop()


INTERNAL = {"server_error", "api_error", "engine_error"}  # a 500's types and code


def check_answer(method: str, path: str, status: int, headers: Any, text: str) -> None:
    """A 2xx, or a typed 4xx (or a typed 503) in the route's protocol shape."""
    where = f"{method} {path} -> {status}: {text[:400]}"
    assert status != 422 and (status < 500 or status == 503), where
    if status >= 400:
        check_error(json.loads(text), path, where)
    elif "text/event-stream" in headers.get("content-type", ""):
        # A stream that started may end with a typed error event, never an internal one.
        for line in text.splitlines():
            data = line.removeprefix("data: ")
            if line.startswith("data: ") and data != "[DONE]" and '"error"' in data:
                event = json.loads(data)
                if "error" in event:
                    check_error(event, path, where)


def check_error(body: dict[str, Any], path: str, where: str) -> None:
    error = protocol_error(body, path, where)
    assert error["type"] not in INTERNAL and error.get("code") not in INTERNAL, where


def healthy(live: LiveServer) -> None:
    r = httpx.get(f"{live.url}/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["status"] == "healthy"


def cheap(body: Any) -> Any:
    """Generation kept to a few tokens: integer caps clamped (the types are left alone,
    so wrong types still reach the server)."""
    if isinstance(body, dict):
        for cap in CAPS:
            value = body.get(cap)
            if isinstance(value, int) and not isinstance(value, bool) and value > 4:
                body[cap] = 4
        if not any(cap in body for cap in CAPS):
            body["profile"] = body.get("profile", "short")
    return body


# -- schemathesis: the app's OpenAPI document ------------------------------------------


def schema_for(live: LiveServer):
    from schemathesis import openapi

    return openapi.from_dict(live.app.openapi())


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_every_operation(fuzzed, mode):
    from schemathesis import GenerationMode

    schema = schema_for(fuzzed)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 20
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    with httpx.Client(base_url=fuzzed.url, timeout=TIMEOUT) as client:
        for op in operations:
            if op.label == "POST /v1/reload":
                continue  # no body or parameters: nothing to fuzz (test_residency_routes has it)
            fuzz_operation(client, op, generation)
            healthy(fuzzed)


def fuzz_operation(client: httpx.Client, op: Any, generation: Any) -> None:
    method = op.method.upper()

    @FUZZ
    @given(case=op.as_strategy(generation_mode=generation))
    def run(case: Any) -> None:
        kwargs: dict[str, Any] = {"params": case.query or None}
        if method in ("POST", "PUT", "PATCH") and not _unset(case.body):
            body = case.body
            kwargs["content"] = body if isinstance(body, bytes) else json.dumps(cheap(body)).encode()
            kwargs["headers"] = {"content-type": case.media_type or "application/json"}
        r = client.request(method, case.formatted_path, **kwargs)
        check_answer(method, case.formatted_path, r.status_code, r.headers, r.text)

    try:
        run()
    except Unsatisfiable:
        # No invalid request exists for an operation without parameters or a body.
        assert generation.value == "negative", op.label


def _unset(value: Any) -> bool:
    return type(value).__name__ == "NotSet"


# -- hypothesis: mutations of valid protocol bodies -------------------------------------

HI = [{"role": "user", "content": "Hi"}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "demo", "messages": HI, "max_tokens": 3},
    "/v1/completions": {"model": "demo", "prompt": "Hi", "max_tokens": 3},
    "/v1/responses": {"model": "demo", "input": "Hi", "max_output_tokens": 3},
    "/v1/messages": {"model": "demo", "messages": HI, "max_tokens": 3},
    "/v1/messages/count_tokens": {"model": "demo", "messages": HI},
    "/v1/estimate": {"model": "demo", "messages": HI},
    "/v1/cache/reset": {"model": "demo"},
    "/v1/keep": {"model": "demo", "keep": False},
    "/unload": {"model": "nope"},
}
FIELDS = sorted({
    "model", "messages", "prompt", "input", "stream", "stop", "stop_sequences", "tools",
    "tool_choice", "response_format", "logit_bias", "temperature", "top_p", "top_k", "seed",
    "logprobs", "top_logprobs", "n", "echo", "suffix", "best_of", "system", "instructions",
    "profile", "stream_options", "chat_template_kwargs", "thinking", "output_config", "text",
    "reasoning", "reasoning_effort", "enable_thinking", "thinking_budget", "timings_per_token",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "xtc_probability",
    "content", "role", "keep", "warm", "dry_run",
})

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=30) | st.sampled_from(["demo", "user", "assistant", "tool", "json_schema",
                                              "function", "text", "image_url", "auto", "none"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "add", "drop", "nest"]))
        if action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "replace" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
        elif action == "nest":
            msgs = body.get("messages")
            if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
                msgs[0][draw(st.sampled_from(["content", "role", "tool_calls", "name"]))] = draw(json_values)
        else:
            body[draw(st.sampled_from(FIELDS))] = draw(json_values)
    raw = json.dumps(cheap(body)).encode()
    how = draw(st.sampled_from(["whole"] * 6 + ["truncated", "bytes", "not-an-object"]))
    if how == "truncated":
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "not-an-object":
        return json.dumps(draw(json_values)).encode()
    return raw


@pytest.mark.parametrize("path", sorted(VALID))
def test_mutated_protocol_bodies(fuzzed, path):
    with httpx.Client(base_url=fuzzed.url, timeout=TIMEOUT) as client:
        base = client.post(path, json=VALID[path])  # well formed (/unload's names no model)
        assert base.status_code == (404 if path == "/unload" else 200), base.text

        @FUZZ
        @given(raw=mutated(VALID[path]))
        def run(raw: bytes) -> None:
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            check_answer("POST", path, r.status_code, r.headers, r.text)

        run()
    healthy(fuzzed)


# -- hostile bodies a client has sent to servers like this one, kept as plain cases ------

HOSTILE = [
    b'{"model": "demo", "messages": [{"role": "user", "content": "Hi"}',  # truncated
    b'{"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
    b'{"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "top_p": 1e309}',
    b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1' + b"0" * 40 + b"}",
    b'{"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "demo", "messages": [{"role": "user", "content": [' + b'{"type": "text"},' * 3 + b'{}]}]}',
    b'{"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "stop": [""], "max_tokens": 2}',
    b'{"model": "demo", "messages": [{"role": "tool", "content": null}], "max_tokens": 2}',
    b"\xff\xfe\x00garbage",
    b"[]",
    b"null",
    b"",
]


@pytest.mark.parametrize("path", sorted(VALID))
@pytest.mark.parametrize("raw", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_regressions(fuzzed, path, raw):
    r = httpx.post(f"{fuzzed.url}{path}", content=raw, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    check_answer("POST", path, r.status_code, r.headers, r.text)
