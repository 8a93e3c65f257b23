"""``POST /v1/chat/completions`` and ``POST /v1/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gmlx.engine.errors import GmlxError
from gmlx.server import generation, sse
from gmlx.server.errors import error_body
from gmlx.server.generation import Job
from gmlx.server.openai import translate
from gmlx.server.openai.schemas import ChatBody, CompletionBody, stop_list

router = APIRouter()


def _headers(job: Job) -> dict[str, str]:
    return {"x-request-id": job.handle.id}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request) -> Response:
    job = await generation.start(
        request,
        body,
        messages=translate.chat_messages(body.messages),
        tools=translate.template_tools(body.tools, body.tool_choice),
        max_tokens=body.output_cap,
        stop=stop_list(body.stop),
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse.stream_response(
            _chat_stream(job, include_usage),
            request.app.state.settings.server.sse_keepalive_s,
            _headers(job),
        )
    result = await generation.collect(job, request)
    return JSONResponse(translate.chat_completion(job, result), headers=_headers(job))


async def _chat_stream(job: Job, include_usage: bool) -> AsyncIterator[str]:
    """Chunks: the role first, then text deltas, the finish, usage if asked, ``[DONE]``."""
    yield sse.event(
        translate.chat_chunk(job, {"role": "assistant", "content": ""}, include_usage=include_usage)
    )
    try:
        async for ev in generation.events(job):
            if ev.text:
                yield sse.event(
                    translate.chat_chunk(job, {"content": ev.text}, include_usage=include_usage)
                )
            if ev.final:
                yield sse.event(
                    translate.chat_chunk(job, {}, ev.finish_reason, include_usage=include_usage)
                )
                if include_usage:
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
        return sse.stream_response(
            _completion_stream(job, include_usage),
            request.app.state.settings.server.sse_keepalive_s,
            _headers(job),
        )
    result = await generation.collect(job, request)
    return JSONResponse(
        translate.completion(job, result.text, result.finish_reason, result.usage),
        headers=_headers(job),
    )


async def _completion_stream(job: Job, include_usage: bool) -> AsyncIterator[str]:
    try:
        async for ev in generation.events(job):
            if ev.text or ev.final:
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
