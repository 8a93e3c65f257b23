"""Anthropic shapes <-> engine values: content blocks in, Message objects out."""

from __future__ import annotations

import json
from typing import Any

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.tools import ToolCall, apply_tool_choice
from gmlx.engine.types import FinishReason, Usage
from gmlx.server.anthropic.schemas import MessagesRequest
from gmlx.server.generation import Job, Result


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


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as the plain chat dicts templates expect.

    ``tool_use`` blocks become assistant tool calls and ``tool_result`` blocks tool
    messages; image blocks are refused (no vision support yet).
    """
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _block_text(body.system, "system", "system")})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for block in m.content:
            kind = block.get("type")
            if kind == "text":
                texts.append(_text(block))
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {"name": block.get("name"), "arguments": arguments},
                    }
                )
            elif kind == "tool_result":
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": _block_text(block.get("content"), "tool_result content"),
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not replayed to the model
            elif kind in ("image", "document"):
                raise InvalidRequestError(
                    f"{kind} blocks need a vision model, and gmlx does not serve one yet.",
                    param="messages",
                )
            else:
                raise InvalidRequestError(
                    f"Unsupported content block type {kind!r}.", param="messages"
                )
        out.extend(results)
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def tools_and_choice(body: MessagesRequest) -> tuple[list[dict[str, Any]] | None, bool]:
    """Anthropic tools in the function shape chat templates expect, after
    ``tool_choice`` (``none`` strips them), and whether a call is forced."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {},
            },
        }
        for t in body.tools or []
    ]
    return apply_tool_choice(tools or None, body.tool_choice)


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
        args = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        args = {"input": call.arguments}
    if not isinstance(args, dict):
        args = {"input": args}
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name, "input": args}


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
        "usage": {
            "input_tokens": job.prompt_tokens,
            "output_tokens": usage.completion_tokens if usage else 0,
            "cache_read_input_tokens": usage.cached_tokens if usage else 0,
        },
    }
