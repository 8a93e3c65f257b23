"""One request inside the engine: the handle front ends consume, and the worker's
per-request state (its detokenizer, stop matcher, processors and timings)."""

from __future__ import annotations

import asyncio
import queue
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gmlx.engine.reasoning import ReasoningSplitter
from gmlx.engine.tokenizer import IncrementalDetokenizer, StopMatcher
from gmlx.engine.tools import ToolCallStream
from gmlx.engine.types import Event, FinishReason, GenerateRequest

if TYPE_CHECKING:
    from gmlx.engine.worker import ModelWorker


class RequestState(StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class RequestHandle:
    """The consumer's end of one request: iterate it for events, or cancel it.

    Iteration yields text events and the final event; a request that failed raises
    its :class:`GmlxError` where it is consumed instead of yielding it.
    """

    def __init__(self, request: GenerateRequest, worker: ModelWorker) -> None:
        self.request = request
        self.id = request.id
        self._worker = worker
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        # The event-loop side: a deque and one waiter future (lighter per token than an
        # asyncio.Queue, which matters where a decode step takes a few milliseconds).
        self._ready: deque[Event | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass

    def _emit(self, event: Event) -> None:
        """Called on the worker thread."""
        if self._loop is None:
            self._sync.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._push, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _push(self, item: Event | None) -> None:
        """On the event loop: queue an event (``None``: a silence tick) and wake the reader."""
        self._ready.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        self._worker.cancel(self.id)

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


@dataclass
class ActiveRequest:
    """Worker-side state of one request."""

    handle: RequestHandle
    detok: IncrementalDetokenizer
    stops: StopMatcher
    state: RequestState = RequestState.QUEUED
    uid: int | None = None
    generated: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    cache_tier: str | None = None
    warm_tokens: int = 0
    processors: list[Any] = field(default_factory=list)  # request-owned logits processors
    splitter: ReasoningSplitter | None = None
    tool_stream: ToolCallStream | None = None
    failure: Exception | None = None  # raised by this request's own sampler or processors
    handed_out: int | None = None  # the first token, handed out before mlx-lm returns it

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
            "speculative": None,
        }

    @property
    def request(self) -> GenerateRequest:
        return self.handle.request
