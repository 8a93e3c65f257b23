"""``POST /v1/chat/completions`` and ``POST /v1/completions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.errors import GmlxError
from gmlx.engine.structured import compile_response_format
from gmlx.engine.tools import apply_tool_choice
from gmlx.engine.types import Event, FinishReason
from gmlx.server import generation, sse
from gmlx.server.admin import capacity as admin_capacity
from gmlx.server.errors import error_body
from gmlx.server.generation import Job
from gmlx.server.openai import translate
from gmlx.server.openai.schemas import ChatBody, CompletionBody, stop_list

router = APIRouter()


def _headers(job: Job) -> dict[str, str]:
    return {"x-request-id": job.handle.id}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request) -> Response:
    if (body.model_extra or {}).get("dry_run") is True:  # the estimate, not a generation
        return JSONResponse(await admin_capacity.estimate_chat(request, body))
    tools, forced = apply_tool_choice(body.tools, body.tool_choice)
    logprobs = bool(body.logprobs)
    job = await generation.start(
        request,
        body,
        messages=translate.chat_messages(body.messages),
        tools=tools,
        max_tokens=body.output_cap,
        stop=stop_list(body.stop),
        grammar=compile_response_format(body.response_format),
        forced_tool=forced,
        logprobs=logprobs,
        top_logprobs=min(body.top_logprobs or 0, translate.top_logprobs_cap()) if logprobs else 0,
    )
    if body.stream:
        options = ChatStreamOptions(
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            logprobs=logprobs,
            timings=bool(body.timings_per_token),
        )
        return sse.stream_response(_chat_stream(job, options), _headers(job))
    result = await generation.collect(job, request)
    return JSONResponse(translate.chat_completion(job, result, logprobs), headers=_headers(job))


@dataclass(frozen=True)
class ChatStreamOptions:
    include_usage: bool
    logprobs: bool
    timings: bool


async def _chat_stream(job: Job, opts: ChatStreamOptions) -> AsyncIterator[str]:
    """Chunks: the role first, then reasoning, text and tool-call deltas, the finish,
    usage if asked, ``[DONE]``. A shed request's finish is followed by its error."""
    started, generated, n_calls = time.monotonic(), 0, 0

    def chunk(delta: dict[str, Any] | None, finish: FinishReason | None = None, **kw: Any) -> str:
        body = translate.chat_chunk(job, delta, finish, include_usage=opts.include_usage, **kw)
        if opts.timings and delta is not None:
            elapsed = time.monotonic() - started
            body["timings"] = {
                "prompt_n": job.prompt_tokens,
                "predicted_n": generated,
                "predicted_ms": round(elapsed * 1000, 3),
                "predicted_per_second": round(generated / elapsed, 3) if elapsed > 0 else None,
            }
        return sse.event(body)

    def template(field: str) -> sse.Template | None:
        """The plain delta chunk of ``field``, serialized once (None where chunks vary)."""
        if opts.logprobs or opts.timings:
            return None
        return sse.Template(translate.chat_chunk(job, {field: sse.FILL}, include_usage=opts.include_usage))

    content, reasoning = template("content"), template("reasoning_content")
    pending: list[Event] = []  # token events whose text has not been sent yet (logprobs)
    yield chunk({"role": "assistant", "content": ""})
    try:
        async for ev in generation.events(job):
            if ev is None:
                yield sse.KEEPALIVE
                continue
            generated += len(ev.token_ids)
            if ev.token_ids:
                pending.append(ev)
            if ev.reasoning:
                yield reasoning(ev.reasoning) if reasoning else chunk({"reasoning_content": ev.reasoning})
            if ev.text:
                if content:
                    yield content(ev.text)
                else:
                    lp = translate.logprob_content(job, pending) if opts.logprobs else None
                    pending = []
                    yield chunk({"content": ev.text}, logprobs=lp)
            if ev.tool_calls:
                calls = [translate.tool_call(c, n_calls + i) for i, c in enumerate(ev.tool_calls)]
                n_calls += len(calls)
                yield chunk({"tool_calls": calls})
            if ev.final:
                if ev.usage is not None:  # an end-of-sequence token is decoded but never sent
                    generated = ev.usage.completion_tokens
                yield chunk({}, ev.finish_reason)
                if ev.error is not None:  # shed: the stream says why
                    yield sse.event(error_body(ev.error, "openai"))
                if opts.include_usage:
                    yield sse.event(
                        translate.chat_chunk(job, None, include_usage=True, final_usage=ev.usage)
                    )
    except GmlxError as e:
        yield sse.event(error_body(e, "openai"))
    yield sse.DONE


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request) -> Response:
    prompt = translate.check_completion_prompt(
        body.prompt, body.n, body.echo, body.suffix, body.best_of
    )
    job = await generation.start(
        request, body, prompt=prompt, max_tokens=body.max_tokens, stop=stop_list(body.stop)
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse.stream_response(_completion_stream(job, include_usage), _headers(job))
    result = await generation.collect(job, request)
    return JSONResponse(
        translate.completion(job, result.text, result.finish_reason, result.usage),
        headers=_headers(job),
    )


async def _completion_stream(job: Job, include_usage: bool) -> AsyncIterator[str]:
    plain = translate.completion(job, sse.FILL, None)
    if include_usage:
        plain["usage"] = None
    text = sse.Template(plain)
    try:
        async for ev in generation.events(job):
            if ev is None:
                yield sse.KEEPALIVE
                continue
            if ev.text and not ev.final:
                yield text(ev.text)
            elif ev.text or ev.final:
                chunk: dict[str, Any] = translate.completion(job, ev.text, ev.finish_reason)
                if include_usage:
                    chunk["usage"] = None
                yield sse.event(chunk)
            if ev.final and include_usage and ev.usage is not None:
                final = translate.completion(job, "", None, ev.usage)
                final["choices"] = []
                yield sse.event(final)
    except GmlxError as e:
        yield sse.event(error_body(e, "openai"))
    yield sse.DONE
