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
from gmlx.engine.types import FinishReason, Usage
from gmlx.server import generation, sse
from gmlx.server.generation import Job
from gmlx.server.openai.schemas import ResponsesBody, ResponsesRequest
from gmlx.server.openai.translate import template_tools, text_of

router = APIRouter()


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


def response_object(
    job: Job,
    body: ResponsesRequest,
    *,
    status: str,
    text: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A Response; ``text`` None means no output item yet (the created/in_progress events)."""
    output = [] if text is None else [_message(job, text, "completed")]
    return {
        "id": f"resp_{job.id}",
        "object": "response",
        "created_at": job.created,
        "status": status,
        "model": job.model,
        "output": output,
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
        "text": {"format": {"type": "text"}},
        "usage": None
        if usage is None
        else {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
    }


def _status(finish: FinishReason | None) -> str:
    return "incomplete" if finish is FinishReason.LENGTH else "completed"


@router.post("/v1/responses")
async def responses(body: ResponsesBody, request: Request) -> Response:
    job = await generation.start(
        request,
        body,
        messages=input_messages(body),
        tools=template_tools(function_tools(body.tools), body.tool_choice),
        max_tokens=body.max_output_tokens,
    )
    headers = {"x-request-id": job.handle.id}
    if body.stream:
        return sse.stream_response(
            _stream(job, body), request.app.state.settings.server.sse_keepalive_s, headers
        )
    result = await generation.collect(job, request)
    status = _status(result.finish_reason)
    return JSONResponse(
        response_object(job, body, status=status, text=result.text, usage=result.usage),
        headers=headers,
    )


async def _stream(job: Job, body: ResponsesRequest) -> AsyncIterator[str]:
    seq = 0

    def emit(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return sse.event({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    item_id = f"msg_{job.id}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield emit("response.created", response=response_object(job, body, status="in_progress"))
    yield emit("response.in_progress", response=response_object(job, body, status="in_progress"))
    yield emit("response.output_item.added", output_index=0, item=_message(job, "", "in_progress"))
    yield emit("response.content_part.added", **where, part=_part(""))
    parts: list[str] = []
    try:
        async for ev in generation.events(job):
            if ev.text:
                parts.append(ev.text)
                yield emit("response.output_text.delta", **where, delta=ev.text, logprobs=[])
            if not ev.final:
                continue
            text = "".join(parts)
            status = _status(ev.finish_reason)
            yield emit("response.output_text.done", **where, text=text, logprobs=[])
            yield emit("response.content_part.done", **where, part=_part(text))
            yield emit(
                "response.output_item.done", output_index=0, item=_message(job, text, "completed")
            )
            final = response_object(job, body, status=status, text=text, usage=ev.usage)
            yield emit("response.completed", response=final)
    except GmlxError as e:
        yield emit("error", code=e.code, message=e.message, param=e.param)
        failed = response_object(job, body, status="failed")
        failed["error"] = {"code": e.code or e.openai_type, "message": e.message}
        yield emit("response.failed", response=failed)
