"""OpenAI shapes <-> engine values: chat and completion bodies in as a
:class:`ChatRequest`, completion objects and chunks out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gmlx.engine.chat import Job, Result
from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import (
    ChatRequest,
    Event,
    FinishReason,
    ImagePart,
    Message,
    Part,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)
from gmlx.server import translate as common
from gmlx.server.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
FORMATS = ("text", "json_object", "json_schema")


# -- in -------------------------------------------------------------------------------


def chat_request(body: ChatCompletionRequest) -> ChatRequest:
    """A chat-completions body as the engine's request."""
    logprobs = bool(body.logprobs)
    return ChatRequest(
        messages=tuple(chat_message(m, f"messages[{i}]") for i, m in enumerate(body.messages)),
        tools=tools(body.tools),
        tool_choice=tool_choice(body.tool_choice),
        response_format=response_format(body.response_format),
        max_tokens=body.output_cap,
        stop=stop_tuple(body.stop),
        logprobs=logprobs,
        top_logprobs=(body.top_logprobs or 0) if logprobs else 0,
        **common.common(body),
    )


def completion_request(body: CompletionRequest) -> ChatRequest:
    """A ``/v1/completions`` body: one string prompt, no template."""
    return ChatRequest(
        prompt=check_completion_prompt(body.prompt, body.n, body.echo, body.suffix, body.best_of),
        max_tokens=body.max_tokens,
        stop=stop_tuple(body.stop),
        **common.common(body),
    )


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...] | None:
    """OpenAI's ``stop`` as a tuple (it may be one string)."""
    if stop is None:
        return None
    return (stop,) if isinstance(stop, str) else tuple(stop)


def chat_message(m: ChatMessage, where: str = "messages") -> Message:
    """One chat message (at ``where`` in the request); ``developer`` is a system
    message, ``function`` a tool result."""
    extra = m.model_extra or {}
    role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
    calls = tuple(_call(c, i) for i, c in enumerate(extra.get("tool_calls") or ()))
    name, call_id, reasoning = (extra.get(k) for k in ("name", "tool_call_id", "reasoning_content"))
    return Message(
        role,
        parts(m.content, at=f"{where}.content"),
        tool_calls=calls,
        tool_call_id=call_id if isinstance(call_id, str) else None,
        name=name if isinstance(name, str) else None,
        reasoning=reasoning if isinstance(reasoning, str) else None,
    )


def _call(call: Any, i: int) -> ToolCall:
    """An assistant message's ``tool_calls`` entry."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            f"tool_calls[{i}] needs a function with a name.", param="messages"
        )
    arguments = function.get("arguments")
    if not isinstance(arguments, str):  # some clients send the object itself
        import json

        arguments = json.dumps(arguments or {}, ensure_ascii=False)
    return ToolCall(str(call.get("id") or ""), function["name"], arguments)


def parts(content: Any, param: str = "messages", at: str | None = None) -> tuple[Part, ...]:
    """Message content given as a string or a list of typed parts; ``at`` is where the
    list is in the request (``messages[2].content``), which an image's errors name.

    Raises InvalidRequestError for parts of unknown types and for content of any other
    shape (Responses input items are not schema-typed, so their content arrives here as
    whatever the client sent).
    """
    if content is None or isinstance(content, str):
        return (TextPart(content),) if content else ()
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"Message content must be a string or a list of parts, not {common.json_type(content)}.",
            param=param,
        )
    out: list[Part] = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequestError(
                f"A content part must be an object, not {common.json_type(part)}.", param=param
            )
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"A {kind} part needs its text as a string, not {common.json_type(text)}.",
                    param=param,
                )
            out.append(TextPart(text))
        elif kind in IMAGE_PARTS:
            url = part.get("image_url")
            if isinstance(url, Mapping):
                url = url.get("url")
            out.append(ImagePart(url if isinstance(url, str) else "",
                                 where=f"{at}[{k}]" if at else None))
        else:
            raise InvalidRequestError(f"Unsupported content part type {kind!r}.", param=param)
    return tuple(out)


def tools(listed: list[dict[str, Any]] | None) -> tuple[Tool, ...]:
    """Chat tools (``{"type": "function", "function": {...}}``, or flat) as engine Tools."""
    out = []
    for i, tool in enumerate(listed or ()):
        where = f"tools[{i}]"
        common.tool_kind(tool, where)
        function = tool.get("function", tool)
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object.", param="tools")
        if function is tool:
            function = {k: v for k, v in tool.items() if k != "type"}
        out.append(common.function_tool(function, where))
    return tuple(out)


def tool_choice(choice: Any) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``none``, ``auto``, ``required`` or a named function
    (``{"type": "function", "function": {"name": N}}``; ``{"type": "auto"}`` and the
    like are accepted too)."""
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind in ("auto", "none", "required"):
            return ToolChoice(ToolChoiceMode(kind))
        if kind == "function":
            function = choice.get("function")
            name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
            if not isinstance(name, str):
                raise InvalidRequestError("tool_choice names no tool.", param="tool_choice")
            return ToolChoice(ToolChoiceMode.NAMED, name)
        raise InvalidRequestError(f"tool_choice type {kind!r} is not supported.",
                                  param="tool_choice")
    if choice is None:
        return ToolChoice()
    if choice in ("auto", "none", "required"):
        return ToolChoice(ToolChoiceMode(choice))
    raise InvalidRequestError(
        f"tool_choice {choice!r} is not one of none, auto, required or a named tool.",
        param="tool_choice",
    )


def response_format(fmt: Any, field: str = "response_format") -> ResponseFormat | None:
    """``response_format``: ``text`` (None), ``json_object``, or ``json_schema`` with
    ``{"name", "schema", "strict"}`` (``strict`` is implied: the schema is always
    enforced). Raises InvalidRequestError for an unknown type or a missing spec."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise InvalidRequestError(f"{field} must be an object.", param=field)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", field=field)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None and "schema" in fmt:
            spec = fmt  # some clients put the schema at the top level
        if not isinstance(spec, Mapping):
            raise InvalidRequestError(
                f"{field}.json_schema must be an object holding a schema.", param=field
            )
        name = spec.get("name")
        return ResponseFormat("json_schema", spec.get("schema"),
                              name if isinstance(name, str) else None, field)
    raise InvalidRequestError(
        f"{field}.type {kind!r} is not supported; use one of {', '.join(FORMATS)}.",
        param=field,
    )


# -- out ------------------------------------------------------------------------------


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason for an engine finish (``stop``, ``length``, ``cancelled``)."""
    return reason.value


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A chat ``tool_calls`` entry; streamed deltas add their ``index``."""
    entry: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return entry if index is None else {"index": index, **entry}


def logprob_content(job: Job, events: Iterable[Event]) -> list[dict[str, Any]]:
    """``logprobs.content`` entries, one per generated token.

    An entry's ``token`` is the text that token released (a character split over
    several tokens is released by its last one), so the entries join to the output
    text exactly; ``bytes`` are that text's UTF-8 bytes.
    """
    tok = job.tokenizer

    def alt(token_id: int, logprob: float) -> dict[str, Any]:
        text = tok.decode([token_id]) if tok is not None else str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {
            "token": ev.text,
            "logprob": ev.logprob,
            "bytes": list(ev.text.encode()),
            "top_logprobs": [alt(i, lp) for i, lp in ev.top_logprobs],
        }
        for ev in events
        if ev.logprob is not None
    ]


def chat_completion(job: Job, result: Result, logprobs: bool = False) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [tool_call(c) for c in result.tool_calls]
        message["content"] = result.text or None
    return {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": logprob_content(job, result.tokens)} if logprobs else None,
                "finish_reason": finish_reason(result.finish_reason),
            }
        ],
        "usage": usage(result.usage),
        "system_fingerprint": None,
    }


def chat_chunk(
    job: Job,
    delta: dict[str, Any] | None,
    finish: FinishReason | None = None,
    *,
    include_usage: bool = False,
    final_usage: Usage | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; with ``final_usage`` it is the usage-only chunk."""
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish_reason(finish) if finish else None,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = usage(final_usage) if final_usage else None
    return chunk


def completion(
    job: Job, text: str, finish: FinishReason | None, u: Usage | None = None
) -> dict[str, Any]:
    """A ``text_completion`` object; streamed chunks use it too, one text delta each."""
    body: dict[str, Any] = {
        "id": f"cmpl-{job.id}",
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason(finish) if finish else None,
            }
        ],
    }
    if u is not None:
        body["usage"] = usage(u)
    return body


def check_completion_prompt(
    prompt: str | list[Any],
    n: int | None,
    echo: bool | None,
    suffix: str | None,
    best_of: int | None,
) -> str:
    """The single string prompt ``/v1/completions`` serves; anything else, a list of
    one string included (the spec rejects every list prompt), is a 400."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(
            "prompt must be one string: lists of prompts and token arrays are not supported.",
            param="prompt",
        )
    rejections = [
        (n is not None and n != 1, "n", "n must be 1: the server returns one choice"),
        (bool(echo), "echo", "echo is not supported"),
        (bool(suffix), "suffix", "suffix is not supported"),
        (best_of is not None and best_of != 1, "best_of", "best_of must be 1"),
    ]
    for bad, param, message in rejections:
        if bad:
            raise InvalidRequestError(f"{message}.", param=param)
    return prompt
