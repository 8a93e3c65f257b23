"""Anthropic shapes <-> engine values: a Messages body in as a :class:`ChatRequest`,
Message objects out."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from gmlx.engine.chat import Job, Result
from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import (
    ChatRequest,
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
from gmlx.server.anthropic.schemas import MessagesRequest
from gmlx.server.openai.translate import response_format

# -- in -------------------------------------------------------------------------------


def messages_request(body: MessagesRequest) -> ChatRequest:
    """A Messages body as the engine's request. Anthropic's ``thinking`` switch
    (``{"type": "enabled", "budget_tokens": N}`` or ``disabled``) maps onto the
    reasoning controls; ``output_config``'s ``json_schema`` format onto structured
    output (``response_format`` is taken too)."""
    thinking = body.thinking or {}
    enabled = {"enabled": True, "disabled": False}.get(str(thinking.get("type")))
    budget = thinking.get("budget_tokens") if enabled else None
    return ChatRequest(
        messages=chat_messages(body),
        tools=tools(body.tools),
        tool_choice=tool_choice(body.tool_choice),
        response_format=output_config(body.output_config) or response_format(body.response_format),
        max_tokens=body.max_tokens,
        stop=tuple(body.stop_sequences) if body.stop_sequences else None,
        **common.common(body, enabled=enabled,
                        budget=budget if isinstance(budget, int) and budget >= 0 else None),
    )


def _block_text(content: Any, where: str, param: str = "messages") -> str:
    """The text of ``system`` or a ``tool_result``'s content: a string or text blocks.

    Raises InvalidRequestError for any other shape, so a block the model would never
    see is refused rather than silently dropped.
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where} must be a string or a list of text blocks.", param=param
        )
    texts: list[str] = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequestError(
                f"{where} takes only text blocks, not {kind!r}.", param=param
            )
        texts.append(_text(block, param))
    return "".join(texts)


def _text(block: dict[str, Any], param: str = "messages") -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError("A text block needs its text as a string.", param=param)
    return text


def _image(block: dict[str, Any], where: str) -> ImagePart:
    source = block.get("source")
    if not isinstance(source, Mapping):
        source = {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', '')};base64,{source.get('data', '')}"
        return ImagePart(url, where=where)
    return ImagePart(str(source.get("url") or ""), where=where)


def chat_messages(body: MessagesRequest) -> tuple[Message, ...]:
    """``system`` and ``messages`` as engine messages.

    ``tool_use`` blocks become assistant tool calls and ``tool_result`` blocks tool
    messages (before the turn's own text); earlier thinking is not replayed. A system
    turn inside ``messages`` stays a system message at its place (the engine folds it
    into a user turn where the template takes system text only first).
    """
    out: list[Message] = []
    if body.system:
        out.append(Message.text("system", _block_text(body.system, "system", "system")))
    for i, m in enumerate(body.messages):
        if m.role == "system":
            out.append(Message.text("system", _block_text(m.content, f"messages[{i}] (system)")))
            continue
        if isinstance(m.content, str):
            out.append(Message.text(m.role, m.content))
            continue
        parts: list[Part] = []
        calls: list[ToolCall] = []
        results: list[Message] = []
        for k, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                parts.append(TextPart(_text(block)))
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(ToolCall(str(block.get("id") or ""), str(block.get("name") or ""),
                                      arguments))
            elif kind == "tool_result":
                content = _block_text(block.get("content"), "tool_result content")
                results.append(Message.text("tool", content, tool_call_id=block.get("tool_use_id")))
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not replayed to the model
            elif kind == "image":
                parts.append(_image(block, f"messages[{i}].content[{k}]"))
            elif kind == "document":
                raise InvalidRequestError(
                    f"messages[{i}].content[{k}]: document blocks are not supported; send "
                    "a document's pages as image blocks, or its text as a text block.",
                    param=f"messages[{i}].content[{k}]",
                )
            else:
                raise InvalidRequestError(
                    f"Unsupported content block type {kind!r}.", param="messages"
                )
        out.extend(results)
        if parts or calls or not results:
            out.append(Message(m.role, _joined(parts), tool_calls=tuple(calls)))
    return tuple(out)


def _joined(parts: list[Part]) -> tuple[Part, ...]:
    """The blocks in their order, adjacent text blocks joined into one part (images
    stay where the client put them: before the text is Anthropic's advice)."""
    out: list[Part] = []
    for part in parts:
        if isinstance(part, TextPart) and out and isinstance(out[-1], TextPart):
            out[-1] = TextPart(out[-1].text + part.text)
        elif not isinstance(part, TextPart) or part.text:
            out.append(part)
    return tuple(out)


def tools(listed: list[dict[str, Any]] | None) -> tuple[Tool, ...]:
    """Anthropic tools (``name``, ``description``, ``input_schema``) as engine Tools."""
    out = []
    for i, tool in enumerate(listed or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"{where} must be an object.", param="tools")
        function = {"name": tool.get("name"), "description": tool.get("description", ""),
                    "parameters": tool.get("input_schema") or {}}
        out.append(common.function_tool(function, where))
    return tuple(out)


def tool_choice(choice: Any) -> ToolChoice:
    """Anthropic's ``tool_choice``: ``{"type": "auto" | "any" | "none"}`` or
    ``{"type": "tool", "name": N}``."""
    if choice is None:
        return ToolChoice()
    kind = choice.get("type") if isinstance(choice, Mapping) else choice
    if kind in ("auto", "none"):
        return ToolChoice(ToolChoiceMode(kind))
    if kind == "any":
        return ToolChoice(ToolChoiceMode.REQUIRED)
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice names no tool.", param="tool_choice")
        return ToolChoice(ToolChoiceMode.NAMED, name)
    raise InvalidRequestError(f"tool_choice type {kind!r} is not supported.", param="tool_choice")


def output_config(config: Any) -> ResponseFormat | None:
    """``output_config``'s format: ``{"type": "json_schema", "schema": {...}}``; None when
    it asks for no format."""
    field = "output_config"
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise InvalidRequestError("output_config must be an object.", param=field)
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        kind = fmt.get("type") if isinstance(fmt, Mapping) else fmt
        raise InvalidRequestError(
            f"output_config.format type {kind!r} is not supported; use 'json_schema'.",
            param=field,
        )
    return ResponseFormat("json_schema", fmt.get("schema"), field=field)


# -- out ------------------------------------------------------------------------------


def stop_reason(finish: FinishReason, stop_sequence: str | None) -> str:
    if finish is FinishReason.LENGTH:
        return "max_tokens"
    if finish is FinishReason.TOOL_CALLS:
        return "tool_use"
    if finish in (FinishReason.SHED, FinishReason.CANCELLED):
        return finish.value
    return "stop_sequence" if stop_sequence else "end_turn"


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A ``tool_use`` block; arguments that are not a JSON object pass as ``{"input": ...}``."""
    try:
        args = json.loads(call.arguments or "{}", parse_float=_json_number)
    except ValueError:  # not JSON, or an integer too long for Python to read
        args = {"input": call.arguments}
    if not isinstance(args, dict):
        args = {"input": args}
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name, "input": args}


def _json_number(text: str) -> float | int:
    """A JSON number with a fraction or exponent, as a value that JSON can write back.

    Beyond a double's range (``1e999``) a float is infinite, which JSON cannot write;
    such a number is an integer, and Python writes an integer's every digit. Raises
    ValueError past the digits Python converts (``sys.get_int_max_str_digits``).
    """
    value = float(text)
    if math.isfinite(value):
        return value
    exact = Decimal(text)
    if exact.adjusted() >= 4000:
        raise ValueError(f"{text} has too many digits")
    return int(exact)


def thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def message(
    job: Job,
    result: Result | None,
    *,
    stop: str | None = None,
    stop_sequence: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A Message; ``result`` None gives the empty shell that ``message_start`` carries."""
    content: list[dict[str, Any]] = []
    if result is not None:
        if result.reasoning:
            content.append(thinking(result.reasoning))
        if result.text or not result.tool_calls:
            content.append({"type": "text", "text": result.text})
        content += [tool_use(c) for c in result.tool_calls]
    return {
        "id": f"msg_{job.id}",
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "usage": message_usage(job, usage),
    }


def message_usage(job: Job, usage: Usage | None) -> dict[str, int]:
    """Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read
    from the prompt cache, so ``input_tokens + cache_read_input_tokens`` is the prompt
    (agents track their context by that sum). Nothing is reported as written to the
    cache: every prompt is cached, at no cost to the client. Without ``usage`` (the
    ``message_start`` of a stream, sent before the cache lookup) the whole prompt
    counts as input; ``message_delta`` then carries the split."""
    prompt, cached = (usage.prompt_tokens, usage.cached_tokens) if usage else (job.prompt_tokens, 0)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens if usage else 0,
    }
