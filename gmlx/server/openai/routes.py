"""``POST /v1/chat/completions`` and ``POST /v1/completions``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.chat import Engine, Job
from gmlx.engine.errors import GmlxError
from gmlx.engine.types import Event, FinishReason
from gmlx.server import sse, streaming
from gmlx.server.errors import error_body
from gmlx.server.openai import translate
from gmlx.server.openai.schemas import (
    ChatBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
)
from gmlx.server.schemas import documented

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=documented(ChatCompletionRequest))
async def chat_completions(body: ChatBody, request: Request) -> Response:
    engine: Engine = request.app.state.engine
    req = translate.chat_request(body)
    if (body.model_extra or {}).get("dry_run") is True:  # the estimate, not a generation
        return JSONResponse((await engine.estimate(req)).as_dict())
    streaming.warn_ignored(request, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        timings = bool(body.timings_per_token)
        return await streaming.start_stream(
            engine, req, lambda job: ChatStream(job, include_usage, req.logprobs, timings),
            failed, request)
    job = await engine.start(req)
    result = await streaming.answer(job, request)
    return JSONResponse(translate.chat_completion(job, result, req.logprobs),
                        headers=streaming.headers(job))


def failed(error: GmlxError) -> str:
    """A stream that failed before its first chunk: the error, then ``[DONE]``."""
    return sse.event(error_body(error, "openai")) + sse.DONE


class ChatStream:
    """Chunks: the role first, then reasoning, text and tool-call deltas, the finish,
    usage if asked, ``[DONE]``. A shed request's finish is followed by its error."""

    def __init__(self, job: Job, include_usage: bool, logprobs: bool, timings: bool) -> None:
        self.job, self.include_usage, self.logprobs, self.timings = job, include_usage, logprobs, timings
        self.started, self.generated, self.calls = time.monotonic(), 0, 0
        self.pending: list[Event] = []  # token events whose text has not been sent yet (logprobs)
        plain = not (logprobs or timings)  # plain delta chunks are serialized once
        self.content = self._template("content") if plain else None
        self.reasoning = self._template("reasoning_content") if plain else None

    def _template(self, field: str) -> sse.Template:
        return sse.Template(translate.chat_chunk(self.job, {field: sse.FILL},
                                                 include_usage=self.include_usage))

    def _chunk(self, delta: dict[str, Any] | None, finish: FinishReason | None = None, **kw: Any) -> str:
        body = translate.chat_chunk(self.job, delta, finish, include_usage=self.include_usage, **kw)
        if self.timings and delta is not None:
            elapsed = time.monotonic() - self.started
            body["timings"] = {
                "prompt_n": self.job.prompt_tokens,
                "predicted_n": self.generated,
                "predicted_ms": round(elapsed * 1000, 3),
                "predicted_per_second": round(self.generated / elapsed, 3) if elapsed > 0 else None,
            }
        return sse.event(body)

    def opening(self) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def event(self, ev: Event) -> str:
        out = ""
        self.generated += len(ev.token_ids)
        if ev.token_ids:
            self.pending.append(ev)
        if ev.reasoning:
            out += self.reasoning(ev.reasoning) if self.reasoning else self._chunk(
                {"reasoning_content": ev.reasoning})
        if ev.text:
            if self.content:
                out += self.content(ev.text)
            else:
                lp = translate.logprob_content(self.job, self.pending) if self.logprobs else None
                self.pending = []
                out += self._chunk({"content": ev.text}, logprobs=lp)
        if ev.tool_calls:
            calls = [translate.tool_call(c, self.calls + i) for i, c in enumerate(ev.tool_calls)]
            self.calls += len(calls)
            out += self._chunk({"tool_calls": calls})
        if ev.final:
            if ev.usage is not None:  # an end-of-sequence token is decoded but never sent
                self.generated = ev.usage.completion_tokens
            out += self._chunk({}, ev.finish_reason)
            if ev.error is not None:  # shed: the stream says why
                out += sse.event(error_body(ev.error, "openai"))
            if self.include_usage:
                out += sse.event(translate.chat_chunk(self.job, None, include_usage=True,
                                                      final_usage=ev.usage))
        return out

    def error(self, error: GmlxError) -> str:
        return sse.event(error_body(error, "openai"))

    def closing(self) -> str:
        return sse.DONE


@router.post("/v1/completions", openapi_extra=documented(CompletionRequest))
async def completions(body: CompletionBody, request: Request) -> Response:
    engine: Engine = request.app.state.engine
    req = translate.completion_request(body)
    streaming.warn_ignored(request, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await streaming.start_stream(
            engine, req, lambda job: CompletionStream(job, include_usage), failed, request)
    job = await engine.start(req)
    result = await streaming.answer(job, request)
    return JSONResponse(
        translate.completion(job, result.text, result.finish_reason, result.usage),
        headers=streaming.headers(job),
    )


class CompletionStream:
    """``text_completion`` chunks, one per text delta, the finish, usage if asked, ``[DONE]``."""

    def __init__(self, job: Job, include_usage: bool) -> None:
        self.job, self.include_usage = job, include_usage
        plain = translate.completion(job, sse.FILL, None)
        if include_usage:
            plain["usage"] = None
        self.text = sse.Template(plain)

    def opening(self) -> str:
        return ""

    def event(self, ev: Event) -> str:
        out = ""
        if ev.text and not ev.final:
            out += self.text(ev.text)
        elif ev.text or ev.final:
            chunk: dict[str, Any] = translate.completion(self.job, ev.text, ev.finish_reason)
            if self.include_usage:
                chunk["usage"] = None
            out += sse.event(chunk)
        if ev.final and self.include_usage and ev.usage is not None:
            final = translate.completion(self.job, "", None, ev.usage)
            final["choices"] = []
            out += sse.event(final)
        return out

    def error(self, error: GmlxError) -> str:
        return sse.event(error_body(error, "openai"))

    def closing(self) -> str:
        return sse.DONE
