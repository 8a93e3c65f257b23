"""One request inside the engine: the handle front ends consume, and the worker's
per-request state (its text pipeline, logits processors and timings)."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gmlx.engine import sampling
from gmlx.engine.errors import InvalidRequestError, PromptTooLongError, SlowClientError
from gmlx.engine.mailbox import Mailbox, mailbox
from gmlx.engine.pipeline import TextPipeline, pipeline_for
from gmlx.engine.reasoning import make_thinking_budget_processor, prompt_opens_thinking
from gmlx.engine.structured import make_grammar_processor
from gmlx.engine.types import Event, FinishReason, GenerateRequest, Usage

if TYPE_CHECKING:
    from gmlx.engine.errors import GmlxError
    from gmlx.engine.tokenizer import Tokenizer
    from gmlx.engine.tools import ToolParser

log = logging.getLogger("gmlx.engine")


class RequestState(StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


_DECODE = RequestState.DECODE  # read once: an enum member costs a lookup on every token


# Events a stream may hold that its reader has not taken yet: past this the reader (a
# client that stopped reading its stream) is too slow, and the stream is cut
# (``SlowClientError``) and its slot freed. A reader that keeps pace holds a few.
MAX_BACKLOG = 4096


class RequestHandle:
    """The consumer's end of one request: iterate it for events, or cancel it.

    Iteration yields text events and the final event; a request that failed raises
    its :class:`GmlxError` where it is consumed instead of yielding it. The handle
    holds the request, its events and ``cancel``, a callable its worker bound at
    submit: nothing of the worker itself.
    """

    def __init__(self, request: GenerateRequest, cancel: Callable[[str], None]) -> None:
        self.request = request
        self.id = request.id
        self._cancel = cancel
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        # The event-loop side: a deque and one waiter future (lighter per token than an
        # asyncio.Queue, which matters where a decode step takes a few milliseconds).
        self._ready: deque[Event | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._cut: GmlxError | None = None  # why the stream was cut on the reader's side
        # called (on the event loop) with the error when the stream is cut
        self.on_cut: Callable[[GmlxError], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mailbox: Mailbox | None = None
        try:
            self._loop = asyncio.get_running_loop()
            self._mailbox = mailbox(self._loop)
        except RuntimeError:
            pass

    def _emit(self, event: Event) -> None:
        """Called on the worker thread."""
        if self._mailbox is None:
            self._sync.put(event)
            return
        self._mailbox.post(self, event)

    def _push(self, item: Event | None) -> None:
        """On the event loop: queue an event (``None``: a silence tick) and wake the
        reader; cut the stream when the reader has fallen ``MAX_BACKLOG`` events behind."""
        if self._cut is not None:
            return
        ready = self._ready
        ready.append(item)
        if len(ready) > MAX_BACKLOG:
            self._cut_slow_reader()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _cut_slow_reader(self) -> None:
        """Drop the backlog for one final error event, free the request's slot (its
        later events are dropped) and tell the sender (``on_cut``), which may be
        blocked on a client that does not read."""
        self._cut = error = SlowClientError(
            f"Request {self.id} was cut: the client read its stream too slowly "
            f"(more than {MAX_BACKLOG} events unread)."
        )
        log.warning("%s", error)
        self._ready.clear()
        self._ready.append(Event(self.id, finish_reason=FinishReason.ERROR, error=error))
        self._cancel(self.id)
        if self.on_cut is not None:
            self.on_cut(error)

    def cancel(self) -> None:
        """Stop the request at its worker's next step; the stream ends ``cancelled``."""
        self._cancel(self.id)

    @staticmethod
    def _check(event: Event) -> Event:
        if event.finish_reason is FinishReason.ERROR and event.error is not None:
            raise event.error
        return event

    def __iter__(self) -> Iterator[Event]:
        if self._loop is not None:
            raise RuntimeError("this request was submitted from an event loop: use `async for`")
        while True:
            try:
                event = self._sync.get(timeout=0.1)  # a timeout keeps Ctrl-C responsive
            except queue.Empty:
                continue
            yield self._check(event)
            if event.final:
                return

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.stream()  # type: ignore[return-value]  # without ticks, never None

    async def stream(self, idle_s: float = 0.0) -> AsyncIterator[Event | None]:
        """The events as they come; with ``idle_s`` > 0 also a ``None`` after every
        ``idle_s`` seconds in which none came (a queued request, a long prefill), so a
        streaming front end can send a keep-alive. One timer serves the whole request:
        an event costs no timer of its own."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("this request was not submitted from an event loop")
        last = loop.time()
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal timer
            now = loop.time()
            if now - last >= idle_s:
                self._push(None)
                timer = loop.call_at(now + idle_s, tick)
            else:
                timer = loop.call_at(last + idle_s, tick)

        if idle_s > 0:
            timer = loop.call_at(last + idle_s, tick)
        try:
            while True:
                while not self._ready:
                    self._waiter = loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                event = self._ready.popleft()
                if event is None:
                    yield None
                    continue
                last = loop.time()
                yield self._check(event)
                if event.final:
                    return
        finally:
            if timer is not None:
                timer.cancel()


def check_request(request: GenerateRequest, vocab_size: int, context_length: int) -> None:
    """Raise InvalidRequestError (or PromptTooLongError) for a request no worker of
    this model can run: an empty prompt, no tokens to generate, a token id outside the
    vocabulary, prompt and max_tokens past the context window, bad sampling values."""
    n = len(request.prompt_tokens)
    if n == 0:
        raise InvalidRequestError("The prompt is empty.", param="prompt")
    if request.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
    if min(request.prompt_tokens) < 0 or max(request.prompt_tokens) >= vocab_size:
        raise InvalidRequestError("The prompt holds a token id outside the vocabulary.")
    if n + request.max_tokens > context_length:
        raise PromptTooLongError(
            f"prompt is too long: {n} prompt tokens + {request.max_tokens} max_tokens = "
            f"{n + request.max_tokens}, which exceeds the context window of {context_length} tokens.",
            param="messages",
        )
    sampling.validate(request.sampling, vocab_size)


@dataclass(eq=False)
class ActiveRequest:
    """Worker-side state of one request: what it has generated, its text pipeline
    and logits processors, and the times the metrics report."""

    handle: RequestHandle
    pipeline: TextPipeline
    processors: list[Any] = field(default_factory=list)  # request-owned logits processors
    state: RequestState = RequestState.QUEUED
    uid: int | None = None
    generated: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    cache_tier: str | None = None
    warm_tokens: int = 0
    failure: Exception | None = None  # raised by this request's own sampler or processors
    handed_out: int | None = None  # the first token, handed out before mlx-lm returns it
    image_key: list[int] | None = None  # an image prompt's prompt-cache key (images by digest)
    speculative: Any = None  # its drafting counts (``drafting.SpecStats``) on a speculative model

    @classmethod
    def prepare(
        cls,
        handle: RequestHandle,
        tokenizer: Tokenizer,
        *,
        think_markers: tuple[str, str] | None = None,
        tool_parser: ToolParser | None = None,
    ) -> ActiveRequest:
        """The state of a submitted request: its text pipeline and its logits
        processors (penalties, the thinking budget, the grammar)."""
        req = handle.request
        inside = False
        if think_markers and (req.split_reasoning or req.thinking_budget is not None):
            inside = prompt_opens_thinking(tokenizer, req.prompt_tokens, think_markers[0])
        pipeline = pipeline_for(req, tokenizer, think_markers=think_markers,
                                starts_inside=inside, tool_parser=tool_parser)
        processors = sampling.make_processors(req.sampling)
        if budget := make_thinking_budget_processor(tokenizer, req.thinking_budget, inside):
            processors.append(budget)
        if grammar := make_grammar_processor(tokenizer, req.grammar):
            processors.append(grammar)
        return cls(handle, pipeline, processors)

    @property
    def request(self) -> GenerateRequest:
        return self.handle.request

    def cache_tokens(self, tokens: list[int]) -> list[int]:
        """What the prompt cache files ``tokens`` (this request's prompt and output)
        under: an image prompt's key in place of its prompt."""
        if self.image_key is None:
            return tokens
        return [*self.image_key, *tokens[len(self.image_key):]]

    @property
    def tokens_held(self) -> int:
        """Prompt and generated tokens: what its KV holds."""
        return len(self.handle.request.prompt_tokens) + self.generated

    # A request's own sampler and logits processors (a grammar, a penalty) run while
    # the batch's next step is built. One that raises must fail that request alone: the
    # guard records the error and stands in a harmless result, so the step goes on for
    # the others, and the request leaves the batch after it (``failure`` is set).

    def guarded_sampler(self, protected_ids: list[int]) -> Callable[[Any], Any]:
        """The request's sampler (XTC never excludes ``protected_ids``), guarded. A
        greedy request's is one of two shared objects (one batched call; it cannot
        fail): ``greedy_logprobs_sampler`` where it asked for log-probabilities, so the
        decode step normalizes its logits for it."""
        sampler = sampling.make_sampler(self.request.sampling, protected_ids)
        if sampler is sampling.greedy_sampler:
            return sampling.greedy_logprobs_sampler if self.request.logprobs else sampler
        return self._guard(sampler, sampling.greedy_sampler)

    def guarded_processors(self) -> list[Callable[[Any, Any], Any]]:
        """The request's logits processors, each guarded but its logit bias (it cannot
        fail, and a decode step finds it by its type to add every row's in one scatter)."""
        return [p if isinstance(p, sampling.LogitBias) else self._guard(p, _unchanged_logits)
                for p in self.processors]

    def _guard(self, fn: Callable[..., Any], stand_in: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any) -> Any:
            if self.failure is None:
                try:
                    return fn(*args)
                except Exception as e:  # noqa: BLE001 - the request ends with it
                    self.failure = e
            return stand_in(*args)

        return guarded

    def take(self, token: int, logprobs: Any, end: str | None) -> FinishReason | None:
        """Take a token the generator returned (``end``: how the generator ended the
        output with it, ``"stop"`` or ``"length"``, or None), run it down the pipeline
        and emit the event it makes. Returns the finish when the output ended.

        A first token handed out early (``handed_out``) comes back from the generator
        once more: then it is not counted again, and only its ending is news."""
        again = self.handed_out is not None
        self.handed_out = None
        if again and end is None:
            return None
        if not again:
            self.generated += 1
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.state = _DECODE
        pipeline = self.pipeline
        # An end-of-sequence token ("stop") has no text and is not reported.
        event = pipeline.feed(None if again or end == "stop" else token, logprobs, end)
        if event is not None:
            self.handle._emit(event)
        return pipeline.finish

    def finish(self, reason: FinishReason, error: GmlxError | None = None) -> None:
        """End the request's stream with its final event: the finish, usage and the
        prompt-cache tier, the error of an ``ERROR`` or ``SHED`` finish."""
        self.state = RequestState.FINISHED
        usage = Usage(len(self.request.prompt_tokens), self.generated, self.warm_tokens)
        self.handle._emit(Event(
            self.handle.id,
            finish_reason=reason,
            usage=usage,
            error=error,
            stop_sequence=self.pipeline.stop_sequence,
            cache_tier=self.cache_tier,
        ))

    def row(self, model: str, position: int | None, now: float) -> dict[str, Any]:
        """This request as a ``requests[]`` row of the metrics snapshot."""
        req = self.request
        decode_s = now - self.first_token_at if self.first_token_at else 0.0
        return {
            "id": req.id,
            "model": model,
            "state": self.state.value,
            "position": position,
            "prompt_tokens": len(req.prompt_tokens),
            "generated": self.generated,
            "max_tokens": req.max_tokens,
            "elapsed_s": round(now - self.submitted_at, 3),
            "ttft_s": round(self.first_token_at - self.submitted_at, 3) if self.first_token_at else None,
            "decode_tok_s": round((self.generated - 1) / decode_s, 2) if decode_s > 0 and self.generated > 1 else None,
            "cache": {"tier": self.cache_tier, "warm_tokens": self.warm_tokens} if self.cache_tier else None,
            "speculative": self.speculative.row() if self.speculative is not None else None,
        }


def _unchanged_logits(tokens: Any, logits: Any) -> Any:
    return logits


def metrics_rows(live: list[ActiveRequest], model: str, now: float) -> list[dict[str, Any]]:
    """One metrics row per live request: queued ones first, in queue order (with
    their position), then those prefilling or decoding."""
    queued = sorted((a for a in live if a.state is RequestState.QUEUED), key=lambda a: a.submitted_at)
    running = [a for a in live if a.state in (RequestState.PREFILL, RequestState.DECODE)]
    return [a.row(model, i + 1, now) for i, a in enumerate(queued)] + [
        a.row(model, None, now) for a in running
    ]
