"""The bodies of the soak: what it sends (valid and bad requests) and how it reads answers.

:func:`valid_body` builds a request the server must serve (OpenAI chat, completions and
Responses, Anthropic messages; maybe structured or with tools, half behind one of 16
shared system prompts); :func:`bad_body` breaks one so the server must refuse it with a
typed 4xx (truncated JSON, wrong types, an unknown model, too many stop strings or
messages, an oversized body...). ``MAX_BODY_BYTES`` and ``MAX_MESSAGES`` are the limits
the soak's server is started with, which the bad bodies exceed. :func:`error_type` and
:func:`stream_event` read what comes back: a protocol's error shape, a streamed event.
"""

from __future__ import annotations

import json
import random
from typing import Any

MAX_BODY_BYTES, MAX_MESSAGES = 1 << 20, 64

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "local", "model", "answers",
         "code", "calls", "tools", "agents", "run", "memory", "server", "green", "red", "weather", "Paris"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
END_EVENTS = {"response.completed", "response.failed", "response.incomplete", "message_stop"}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


SYSTEMS = [f"System {i}. " + words(random.Random(i), 300) for i in range(16)]


# -- what is sent ------------------------------------------------------------------------


def valid_body(kind: str, model: str, rng: random.Random, stream: bool) -> dict[str, Any]:
    """A request the server must serve: the shape of ``kind``, maybe structured or with tools."""
    system = rng.choice(SYSTEMS) if rng.random() < 0.5 else None
    user, max_tokens, extra = words(rng, rng.randint(3, 60)), rng.randint(4, 40), rng.random()
    body: dict[str, Any] = {"model": model, "stream": stream}
    if kind == "completions":
        return body | {"prompt": (system or "") + user, "max_tokens": max_tokens}
    if kind == "messages":
        body |= {"messages": [{"role": "user", "content": user}], "max_tokens": max_tokens}
        if system:
            body["system"] = system
        if extra < 0.2:
            body["tools"] = [{"name": "weather", "description": "Weather", "input_schema": PARAMS}]
        return body
    if kind == "responses":
        body |= {"input": user, "max_output_tokens": max_tokens}
        if system:
            body["instructions"] = system
        if extra < 0.15:
            body["text"] = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA}}
        elif extra < 0.3:
            body["tools"] = [{"type": "function", "name": "weather", "parameters": PARAMS}]
        return body
    messages = [{"role": "system", "content": system}] if system else []
    body |= {"messages": [*messages, {"role": "user", "content": user}], "max_tokens": max_tokens}
    if extra < 0.15:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    elif extra < 0.3:
        body["tools"] = [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}}]
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def bad_body(kind: str, model: str, rng: random.Random) -> tuple[str, bytes]:
    """A body the server must refuse with a typed 4xx: (what is wrong, the bytes)."""
    body = valid_body(kind, model, rng, rng.random() < 0.5)
    text_key = {"chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages"}[kind]
    wrong = rng.choice(("truncated", "not json", "empty", "wrong type", "wrong type", "unknown model",
                        "stop list", "messages", "oversized", "missing", "negative", "bad schema"))
    if wrong == "truncated":
        raw = json.dumps(body)
        return wrong, raw[: rng.randrange(1, len(raw) - 1)].encode()
    if wrong == "not json":
        return wrong, rng.randbytes(rng.randint(1, 64))
    if wrong == "empty":
        return wrong, b""
    if wrong == "wrong type":
        cap_key = "max_output_tokens" if kind == "responses" else "max_tokens"
        key, value = rng.choice([(text_key, 42), (cap_key, "many"), ("temperature", "hot"),
                                 ("stream", "often"), ("model", ["demo"]), (text_key, {"a": None})])
        body[key] = value
    elif wrong == "unknown model":
        body["model"] = f"no-such-model-{rng.randrange(10**6)}"
    elif wrong == "stop list":
        body["stop_sequences" if kind == "messages" else "stop"] = [f"s{i}" for i in range(64)]
        if kind == "responses":
            body["input"] = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 10)
    elif wrong == "messages":
        item = "hi" if kind == "completions" else {"role": "user", "content": "hi"}
        body[text_key] = [item] * (MAX_MESSAGES + 10)
    elif wrong == "oversized":
        body[text_key if kind == "completions" else "model"] = "x" * (MAX_BODY_BYTES + 1024)
    elif wrong == "missing":
        body.pop(text_key)
    elif wrong == "negative":
        body["max_output_tokens" if kind == "responses" else "max_tokens"] = -rng.randint(1, 100)
    elif kind == "chat":  # a schema or tool that is not one, an option the route refuses
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}
    elif kind == "responses":
        body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": 7}}
    elif kind == "messages":
        body["tools"] = [{"name": 5}]
    else:
        body["n"] = 3
    return wrong, json.dumps(body).encode()


# -- what comes back -----------------------------------------------------------------------


def error_type(body: Any, anthropic_shape: bool) -> str | None:
    """The error's type when ``body`` is the protocol's error shape, else None."""
    if not isinstance(body, dict) or not isinstance(err := body.get("error"), dict):
        return None
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return None
    if anthropic_shape:
        return err["type"] if body.get("type") == "error" else None
    return err["type"] if "param" in err and "code" in err else None


def stream_event(kind: str, data: dict[str, Any]) -> str | None:
    """What one streamed JSON event is: "text", "finish", "error" or None (anything else)."""
    if kind in ("chat", "completions"):
        if "error" in data:
            return "error"
        choice = (data.get("choices") or [{}])[0]
        if choice.get("finish_reason"):
            return "finish"
        delta = choice.get("delta") or {}
        return "text" if choice.get("text") or delta.get("content") or delta.get("tool_calls") else None
    kind_of = str(data.get("type", ""))
    if kind_of == "error":
        return "error"
    if kind_of in END_EVENTS:
        return "finish"
    return "text" if kind_of.endswith(".delta") or kind_of == "content_block_delta" else None
