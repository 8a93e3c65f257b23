"""``POST /v1/responses``: OpenAI Responses, whole or as its typed event stream.

A stream is: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per text piece),
response.output_text.done, response.content_part.done, response.output_item.done,
then response.completed. Every event carries a ``sequence_number``. A response cut
by the output cap still ends with response.completed, its status ``incomplete``:
OpenAI sends response.incomplete there, but the SDK's stream helper and agent
clients wait for response.completed and fail without it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.errors import GmlxError, InvalidRequestError
from gmlx.engine.structured import Grammar, compile_response_format
from gmlx.engine.tools import ToolCall, apply_tool_choice
from gmlx.engine.types import FinishReason, Usage
from gmlx.server import generation, sse
from gmlx.server.generation import Job, Result
from gmlx.server.openai.schemas import ResponsesBody, ResponsesRequest
from gmlx.server.openai.translate import text_of

router = APIRouter()

INPUT_ROLES = ("user", "assistant", "system", "developer")  # of Responses message items


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """Responses ``instructions`` and ``input`` items as chat messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role", "user")
            if role not in INPUT_ROLES:
                raise InvalidRequestError(
                    f"Unsupported input message role {role!r}; use one of "
                    f"{', '.join(INPUT_ROLES)}.",
                    param="input",
                )
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": text_of(item.get("content"), param="input"),
                }
            )
        elif kind == "function_call":
            call = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": item.get("call_id"), "type": "function", "function": call}
                    ],
                }
            )
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": str(item.get("output") or ""),
                }
            )
        else:
            raise InvalidRequestError(f"Unsupported input item type {kind!r}.", param="input")
    return messages


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) in the chat-completions shape templates expect."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
        }
        for t in tools
        if t.get("type") == "function"
    ] or None


def _message(job: Job, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_part(text)]
    return {
        "type": "message",
        "id": f"msg_{job.id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning(job: Job, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{job.id}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _function_call(call: ToolCall, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": call.id.replace("call_", "fc_", 1),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def output_items(job: Job, result: Result) -> list[dict[str, Any]]:
    """The output of a finished response: reasoning, the message, then function calls."""
    items = [_reasoning(job, result.reasoning)] if result.reasoning else []
    if result.text or not result.tool_calls:
        items.append(_message(job, result.text, "completed"))
    return items + [_function_call(c) for c in result.tool_calls]


def response_object(
    job: Job,
    body: ResponsesRequest,
    *,
    status: str,
    output: list[dict[str, Any]] | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A Response; ``output`` None means no output item yet (the created/in_progress events)."""
    return {
        "id": f"resp_{job.id}",
        "object": "response",
        "created_at": job.created,
        "status": status,
        "model": job.model,
        "output": output or [],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": {},
        "parallel_tool_calls": False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "usage": None
        if usage is None
        else {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
    }


def _status(finish: FinishReason | None) -> str:
    return "incomplete" if finish is FinishReason.LENGTH else "completed"


def response_grammar(body: ResponsesRequest) -> Grammar | None:
    """Structured output: Responses' ``text.format`` (flat json_schema), or ``response_format``."""
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return compile_response_format(fmt or body.response_format)


@router.post("/v1/responses")
async def responses(body: ResponsesBody, request: Request) -> Response:
    tools, forced = apply_tool_choice(function_tools(body.tools), body.tool_choice)
    job = await generation.start(
        request,
        body,
        messages=input_messages(body),
        tools=tools,
        max_tokens=body.max_output_tokens,
        grammar=response_grammar(body),
        forced_tool=forced,
    )
    headers = {"x-request-id": job.handle.id}
    if body.stream:
        return sse.stream_response(_stream(job, body), headers)
    result = await generation.collect(job, request)
    status = _status(result.finish_reason)
    return JSONResponse(
        response_object(job, body, status=status, output=output_items(job, result), usage=result.usage),
        headers=headers,
    )


async def _stream(job: Job, body: ResponsesRequest) -> AsyncIterator[str]:
    """Output items open as their content arrives (reasoning, the message, each function
    call) and each is done before the next is added."""
    seq = 0

    def emit(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return sse.event({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    output: list[dict[str, Any]] = []
    current: str | None = None  # "reasoning" | "message" while one is open
    buffer: list[str] = []

    def close() -> list[str]:
        nonlocal current
        if current is None:
            return []
        text, index = "".join(buffer), len(output)
        buffer.clear()
        if current == "reasoning":
            item = _reasoning(job, text)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            lines = [emit("response.reasoning_text.done", **where, text=text)]
        else:
            item = _message(job, text, "completed")
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            lines = [emit("response.output_text.done", **where, text=text, logprobs=[]),
                     emit("response.content_part.done", **where, part=_part(text))]
        lines.append(emit("response.output_item.done", output_index=index, item=item))
        output.append(item)
        current = None
        return lines

    def open_item(kind: str) -> list[str]:
        nonlocal current
        lines = close()
        current, index = kind, len(output)
        if kind == "reasoning":
            item = {**_reasoning(job, ""), "content": [], "status": "in_progress"}
            return [*lines, emit("response.output_item.added", output_index=index, item=item)]
        item = _message(job, "", "in_progress")
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [*lines, emit("response.output_item.added", output_index=index, item=item),
                emit("response.content_part.added", **where, part=_part(""))]

    yield emit("response.created", response=response_object(job, body, status="in_progress"))
    yield emit("response.in_progress", response=response_object(job, body, status="in_progress"))
    try:
        async for ev in generation.events(job):
            if ev is None:
                yield sse.KEEPALIVE
                continue
            for kind, delta in (("reasoning", ev.reasoning), ("message", ev.text)):
                if not delta:
                    continue
                if current != kind:
                    for line in open_item(kind):
                        yield line
                buffer.append(delta)
                item_id = f"rs_{job.id}" if kind == "reasoning" else f"msg_{job.id}"
                where = {"item_id": item_id, "output_index": len(output), "content_index": 0}
                if kind == "reasoning":
                    yield emit("response.reasoning_text.delta", **where, delta=delta)
                else:
                    yield emit("response.output_text.delta", **where, delta=delta, logprobs=[])
            for call in ev.tool_calls:
                for line in close():
                    yield line
                index, item = len(output), _function_call(call)
                yield emit("response.output_item.added", output_index=index,
                           item=_function_call(call, "", "in_progress"))
                yield emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=call.arguments)
                yield emit("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=call.arguments)
                yield emit("response.output_item.done", output_index=index, item=item)
                output.append(item)
            if not ev.final:
                continue
            if not output and current is None:  # an empty answer is an empty message
                for line in open_item("message"):
                    yield line
            for line in close():
                yield line
            if ev.error is not None:
                raise ev.error
            final = response_object(job, body, status=_status(ev.finish_reason), output=output, usage=ev.usage)
            yield emit("response.completed", response=final)
    except GmlxError as e:
        yield emit("error", code=e.code, message=e.message, param=e.param)
        failed = response_object(job, body, status="failed")
        failed["error"] = {"code": e.code or e.openai_type, "message": e.message}
        yield emit("response.failed", response=failed)
