"""What every generation route does between its schema and its response format.

:func:`start` resolves the addressed model and profile, renders and tokenizes the
prompt off the event loop, stacks profile and request values, and submits the
request; the prompt-too-long check runs inside ``submit``, so it fails as a plain
HTTP error before any stream begins. :func:`collect` and :func:`events` consume the
engine's events and cancel the request when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from gmlx.engine.errors import GmlxError, InvalidRequestError
from gmlx.engine.types import Event, FinishReason, GenerateRequest, Usage

if TYPE_CHECKING:
    from gmlx.engine.profiles import Profile
    from gmlx.engine.requests import RequestHandle
    from gmlx.engine.residency import Registry
    from gmlx.engine.structured import Grammar
    from gmlx.engine.tokenizer import Tokenizer
    from gmlx.engine.tools import ToolCall
    from gmlx.engine.worker import ModelWorker
    from gmlx.server.schemas import GenerationBody

log = logging.getLogger("gmlx.server")


@dataclass
class Job:
    """A submitted request and what its responses echo back."""

    handle: RequestHandle
    model: str  # the name the response reports: what the request asked for, else the id
    prompt_tokens: int
    created: int
    tokenizer: Tokenizer | None = None  # names the alternatives of top_logprobs
    keepalive_s: float = 0.0  # a streamed answer's silences longer than this get a tick

    @property
    def id(self) -> str:
        """The engine request id without its ``req-`` prefix, for protocol ids."""
        return self.handle.id.removeprefix("req-")


@dataclass
class Result:
    """A finished request, collected."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tokens: list[Event] = field(default_factory=list)  # events that carry a token (logprobs)


def warn_ignored(request: Request, body: GenerationBody) -> None:
    """One warning line naming every field this route accepted but does not honour."""
    if names := body.ignored():
        log.warning("%s: ignored parameters: %s", request.url.path, ", ".join(names))


@dataclass
class Rendered:
    """A prompt rendered and tokenized for the model it addressed."""

    worker: ModelWorker
    profile: Profile
    model: str
    ids: list[int]


# A prompt this short (characters of message content) renders and tokenizes on the
# event loop: about 0.3-0.7 ms on a slow CPU, which a hop to a worker thread would only
# lengthen. Longer ones go off the loop, where the tokenizer lets go of the GIL while it
# works, so the streams the loop serves keep going meanwhile.
INLINE_CHARS = 1024


async def render(
    request: Request,
    body: GenerationBody,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Rendered:
    """Resolve the addressed model and profile (loading the model if needed, off the
    loop) and tokenize chat ``messages`` through its template, or a raw ``prompt``
    (off the loop when longer than ``INLINE_CHARS``).
    """
    registry: Registry = request.app.state.registry
    target = registry.address(body.model, body.profile)
    worker = registry.running(target.spec.id) or await asyncio.to_thread(registry.worker, target.spec.id)
    profile = registry.profile(target, worker.loaded)
    tokenizer = worker.loaded.tokenizer
    if messages is not None:
        if profile.system and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": profile.system}, *messages]
        kwargs = body.template_kwargs(profile.chat_template_kwargs)
        if not tools and sum(len(str(m.get("content") or "")) for m in messages) <= INLINE_CHARS:
            ids = _encode_chat(tokenizer, messages, tools, kwargs)
        else:
            ids = await asyncio.to_thread(_encode_chat, tokenizer, messages, tools, kwargs)
    elif len(prompt or "") <= INLINE_CHARS:
        ids = tokenizer.encode(prompt or "")
    else:
        ids = await asyncio.to_thread(tokenizer.encode, prompt or "")
    return Rendered(worker, profile, body.model or target.spec.id, ids)


async def start(
    request: Request,
    body: GenerationBody,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] | None = None,
    grammar: Grammar | None = None,
    forced_tool: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> Job:
    """Submit one request (chat ``messages`` or a raw ``prompt``) to its model's worker.

    Explicit ``max_tokens`` and ``stop`` win over the profile's. Chat requests get
    their reasoning split out and, with ``tools``, their tool calls parsed; a
    ``grammar`` constrains the output. Raises GmlxError (unknown model or profile,
    prompt too long, bad sampling values or schema, a model that fails to load)
    before anything is streamed.
    """
    warn_ignored(request, body)
    r = await render(request, body, messages=messages, prompt=prompt, tools=tools)
    if grammar is None and forced_tool and tools:  # make "required" mean it where we can
        from gmlx.engine.tools import forced_call_grammar

        grammar = forced_call_grammar(r.worker.tool_parser, r.worker.loaded.tokenizer, tools)
    if grammar is not None:  # the first structured request builds the vocabulary index
        from gmlx.engine.structured import llg_tokenizer

        await asyncio.to_thread(llg_tokenizer, r.worker.loaded.tokenizer)
    request.app.state.preflight(request, r, max_tokens)  # memory check: admin/capacity.py
    if max_tokens is None:
        max_tokens = r.profile.max_tokens
    if max_tokens is None:  # unset everywhere: whatever the context window leaves
        max_tokens = max(1, r.worker.loaded.context_length - len(r.ids))
    engine_request = GenerateRequest(
        tuple(r.ids),
        max_tokens=max_tokens,
        sampling=r.profile.sampling_params(body.sampling()),
        stop=tuple(stop) if stop else r.profile.stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        grammar=grammar,
        tools=tuple(tools) if tools else None,
        tool_choice_forced=forced_tool,
        split_reasoning=messages is not None,
        thinking_budget=body.thinking_budget,
    )
    handle = r.worker.submit(engine_request)
    keepalive_s = request.app.state.settings.server.sse_keepalive_s
    return Job(handle, r.model, len(r.ids), int(time.time()), r.worker.loaded.tokenizer, keepalive_s)


def _encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> list[int]:
    try:
        return tokenizer.encode_chat(messages, tools=tools, **kwargs)
    except GmlxError:
        raise
    except Exception as e:  # jinja raises many types; all mean the messages do not fit the template
        raise InvalidRequestError(
            f"The model's chat template cannot render these messages: {e}.", param="messages"
        ) from e


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    # The body is already read, so the next ASGI message is the client leaving.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def collect(job: Job, request: Request) -> Result:
    """Wait for the whole answer; a client that disconnects meanwhile cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job.handle))
    parts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    tokens: list[Event] = []
    try:
        async for ev in job.handle:
            parts.append(ev.text)
            reasoning.append(ev.reasoning)
            calls.extend(ev.tool_calls)
            if ev.token_ids:
                tokens.append(ev)
            if ev.final:
                assert ev.finish_reason is not None and ev.usage is not None
                if ev.finish_reason is FinishReason.SHED and ev.error is not None:
                    raise ev.error  # whole responses have no stream to carry it in
                return Result("".join(parts), ev.finish_reason, ev.usage, ev.stop_sequence,
                              "".join(reasoning), calls, tokens)
    finally:
        watcher.cancel()
    raise AssertionError("a request stream ended without a final event")


async def events(job: Job) -> AsyncIterator[Event | None]:
    """The request's events for a stream, with ``None`` for every ``job.keepalive_s``
    of silence (the stream sends a keep-alive comment); closing the iterator early (a
    disconnect) cancels the request."""
    finished = False
    try:
        async for ev in job.handle.stream(job.keepalive_s):
            finished = ev is not None and ev.final
            yield ev
    finally:
        if not finished:
            job.handle.cancel()
