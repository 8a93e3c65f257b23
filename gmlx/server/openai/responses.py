"""``POST /v1/responses``: OpenAI Responses, whole or as its typed event stream.

A stream is: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per text piece),
response.output_text.done, response.content_part.done, response.output_item.done
(a call's item: added, response.function_call_arguments.delta and .done, or
response.custom_tool_call_input.delta and .done for a custom tool, then done), then
response.completed. Every event carries a ``sequence_number``. A response cut
by the output cap still ends with response.completed, its status ``incomplete``:
OpenAI sends response.incomplete there, but the SDK's stream helper and agent
clients wait for response.completed and fail without it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.chat import Engine, Job, Result
from gmlx.engine.errors import GmlxError
from gmlx.engine.types import ChatRequest, Event, FinishReason, ToolCall, Usage
from gmlx.server import sse, streaming
from gmlx.server.openai import responses_input as items
from gmlx.server.openai import translate
from gmlx.server.openai.schemas import ResponsesBody, ResponsesRequest
from gmlx.server.schemas import documented

router = APIRouter()


def responses_request(body: ResponsesRequest) -> ChatRequest:
    """A Responses body as the engine's request."""
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # flat: name, schema, strict
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return ChatRequest(
        messages=items.input_messages(body.instructions, body.input),
        tools=translate.tools(items.function_tools(body.tools)),
        tool_choice=translate.tool_choice(items.tool_choice(body.tool_choice)),
        response_format=translate.response_format(fmt or body.response_format),
        max_tokens=body.max_output_tokens,
        **translate.common.common(body),
    )


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


def _custom_call(call: ToolCall, text: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "custom_tool_call",
        "id": call.id.replace("call_", "ctc_", 1),
        "call_id": call.id,
        "name": call.name,
        "input": items.custom_input(call.arguments) if text is None else text,
        "status": status,
    }


def output_items(job: Job, result: Result, custom: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The output of a finished response: reasoning, the message, then the calls
    (``custom_tool_call`` items for the ``custom`` tools, else ``function_call``)."""
    out = [_reasoning(job, result.reasoning)] if result.reasoning else []
    if result.text or not result.tool_calls:
        out.append(_message(job, result.text, "completed"))
    return out + [_custom_call(c) if c.name in custom else _function_call(c) for c in result.tool_calls]


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


@router.post("/v1/responses", openapi_extra=documented(ResponsesRequest))
async def responses(body: ResponsesBody, request: Request) -> Response:
    engine: Engine = request.app.state.engine
    req = responses_request(body)
    streaming.warn_ignored(request, body, dropped_tools=items.dropped_tools(body.tools))
    if body.stream:
        return await streaming.start_stream(
            engine, req, lambda job: ResponseStream(job, body), failed, request)
    job = await engine.start(req)
    result = await streaming.answer(job, request)
    status = _status(result.finish_reason)
    output = output_items(job, result, items.custom_tools(body.tools))
    return JSONResponse(
        response_object(job, body, status=status, output=output, usage=result.usage),
        headers=streaming.headers(job),
    )


def failed(error: GmlxError) -> str:
    """A stream that failed before its response was created: the ``error`` event."""
    fields = {"type": "error", "sequence_number": 0, "code": error.code,
              "message": error.message, "param": error.param}
    return sse.event(fields, "error")


class ResponseStream:
    """Output items open as their content arrives (reasoning, the message, each call)
    and each is done before the next is added. Every event is numbered."""

    def __init__(self, job: Job, body: ResponsesRequest) -> None:
        self.job, self.body = job, body
        self.custom = items.custom_tools(body.tools)
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.current: str | None = None  # "reasoning" | "message" while one is open
        self.buffer: list[str] = []

    def emit(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse.event({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def close(self) -> str:
        if self.current is None:
            return ""
        job, text, index = self.job, "".join(self.buffer), len(self.output)
        self.buffer.clear()
        if self.current == "reasoning":
            item = _reasoning(job, text)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = self.emit("response.reasoning_text.done", **where, text=text)
        else:
            item = _message(job, text, "completed")
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = (self.emit("response.output_text.done", **where, text=text, logprobs=[])
                   + self.emit("response.content_part.done", **where, part=_part(text)))
        out += self.emit("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.current = None
        return out

    def open_item(self, kind: str) -> str:
        out = self.close()
        self.current, index = kind, len(self.output)
        if kind == "reasoning":
            item = {**_reasoning(self.job, ""), "content": [], "status": "in_progress"}
            return out + self.emit("response.output_item.added", output_index=index, item=item)
        item = _message(self.job, "", "in_progress")
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return (out + self.emit("response.output_item.added", output_index=index, item=item)
                + self.emit("response.content_part.added", **where, part=_part("")))

    def call(self, call: ToolCall) -> str:
        """A call's item, whole: added, its arguments (or custom input), done."""
        index = len(self.output)
        if call.name in self.custom:
            item, field, kind = _custom_call(call), "input", "response.custom_tool_call_input"
            added = _custom_call(call, "", "in_progress")
        else:
            item, field, kind = _function_call(call), "arguments", "response.function_call_arguments"
            added = _function_call(call, "", "in_progress")
        where = {"item_id": item["id"], "output_index": index}
        out = (self.emit("response.output_item.added", output_index=index, item=added)
               + self.emit(f"{kind}.delta", **where, delta=item[field])
               + self.emit(f"{kind}.done", **where, **{field: item[field]})
               + self.emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def opening(self) -> str:
        shell = response_object(self.job, self.body, status="in_progress")
        return self.emit("response.created", response=shell) + self.emit(
            "response.in_progress", response=shell)

    def event(self, ev: Event) -> str:
        out, job = "", self.job
        for kind, delta in (("reasoning", ev.reasoning), ("message", ev.text)):
            if not delta:
                continue
            if self.current != kind:
                out += self.open_item(kind)
            self.buffer.append(delta)
            item_id = f"rs_{job.id}" if kind == "reasoning" else f"msg_{job.id}"
            where = {"item_id": item_id, "output_index": len(self.output), "content_index": 0}
            if kind == "reasoning":
                out += self.emit("response.reasoning_text.delta", **where, delta=delta)
            else:
                out += self.emit("response.output_text.delta", **where, delta=delta, logprobs=[])
        for call in ev.tool_calls:
            out += self.close() + self.call(call)
        if not ev.final:
            return out
        if not self.output and self.current is None:  # an empty answer is an empty message
            out += self.open_item("message")
        out += self.close()
        if ev.error is not None:  # shed: the response fails with its error
            return out + self.error(ev.error)
        final = response_object(job, self.body, status=_status(ev.finish_reason),
                                output=self.output, usage=ev.usage)
        return out + self.emit("response.completed", response=final)

    def error(self, error: GmlxError) -> str:
        failed = response_object(self.job, self.body, status="failed")
        failed["error"] = {"code": error.code or error.openai_type, "message": error.message}
        return (self.emit("error", code=error.code, message=error.message, param=error.param)
                + self.emit("response.failed", response=failed))

    def closing(self) -> str:
        return ""
