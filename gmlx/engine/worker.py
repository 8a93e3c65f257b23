"""One worker thread per resident model: it owns MLX and runs mlx-lm's BatchGenerator.

Front ends call :meth:`ModelWorker.submit` from any thread and consume the returned
:class:`RequestHandle`, synchronously (the CLI) or with ``async for`` (the server,
without blocking its event loop). All MLX work happens on the worker's thread; the
handle only moves :class:`Event` objects across.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gmlx.engine import sampling
from gmlx.engine.errors import (
    EngineError,
    GmlxError,
    InvalidRequestError,
    PromptTooLongError,
)
from gmlx.engine.loading import LoadedModel
from gmlx.engine.tokenizer import IncrementalDetokenizer, StopMatcher
from gmlx.engine.types import Event, FinishReason, GenerateRequest, Usage

log = logging.getLogger("gmlx.engine")

DEFAULT_DECODE_BATCH = 8
DEFAULT_PREFILL_STEP = 512


# Workers still running at interpreter exit are closed first: MLX aborts the process
# if its scheduler still holds a thread's asynchronous work during finalization.
_live_workers: weakref.WeakSet[ModelWorker] = weakref.WeakSet()


# A finished worker thread never returns: it parks here. MLX keeps a compile cache
# per thread whose destructor takes the GIL when the thread exits; a thread that
# exits while the interpreter finalizes is killed inside that destructor and the
# process aborts. A parked thread holds no GIL and dies quietly with the process.
_PARK = threading.Event()


def _thread_main(holder: list[ModelWorker]) -> None:
    worker = holder.pop()  # the thread keeps no reference: an unloaded model is freed
    worker._run()
    del worker
    _PARK.wait()


@atexit.register
def _close_live_workers() -> None:
    for worker in list(_live_workers):
        worker.close()


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
        self._async: asyncio.Queue[Event] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._loop = asyncio.get_running_loop()
            self._async = asyncio.Queue()
        except RuntimeError:
            pass

    def _emit(self, event: Event) -> None:
        """Called on the worker thread."""
        if self._loop is None:
            self._sync.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, event)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

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

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._async is None:
            raise RuntimeError("this request was not submitted from an event loop")
        while True:
            event = await self._async.get()
            yield self._check(event)
            if event.final:
                return


@dataclass
class _Active:
    """Worker-side state of one request."""

    handle: RequestHandle
    detok: IncrementalDetokenizer
    stops: StopMatcher
    state: RequestState = RequestState.QUEUED
    uid: int | None = None
    generated: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def request(self) -> GenerateRequest:
        return self.handle.request


class ModelWorker:
    """Runs one loaded model on its own thread with continuous batching.

    Args:
        loaded: the model and tokenizer.
        decode_batch: how many requests decode together; the rest wait in FIFO order.
        prefill_step_size: prompt tokens processed per step, so a long prompt does
            not stall the streams already decoding.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        decode_batch: int = DEFAULT_DECODE_BATCH,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
    ) -> None:
        if decode_batch < 1:
            raise ValueError("decode_batch must be >= 1")
        self.loaded = loaded
        self.decode_batch = decode_batch
        self.prefill_step_size = prefill_step_size
        self.vocab_size = int(loaded.config.get("vocab_size") or len(loaded.tokenizer))
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending: deque[_Active] = deque()
        self._by_uid: dict[int, _Active] = {}
        self._requests: dict[str, _Active] = {}
        self._closed = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=_thread_main, args=([self],), name=f"gmlx-worker-{loaded.id}", daemon=True
        )
        self._thread.start()
        _live_workers.add(self)

    # -- front-end API (any thread) ---------------------------------------------

    def submit(self, request: GenerateRequest) -> RequestHandle:
        """Validate and queue a request. Raises GmlxError for a request that cannot run."""
        self.validate(request)
        if self._closed.is_set():
            raise EngineError(f"The worker for {self.loaded.id} is shut down.")
        handle = RequestHandle(request, self)
        self._inbox.put(("submit", handle))
        return handle

    def validate(self, request: GenerateRequest) -> None:
        n = len(request.prompt_tokens)
        if n == 0:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
        if any(not 0 <= t < self.vocab_size for t in request.prompt_tokens):
            raise InvalidRequestError("The prompt holds a token id outside the vocabulary.")
        budget = self.loaded.context_length
        if n + request.max_tokens > budget:
            raise PromptTooLongError(
                f"prompt is too long: {n} prompt tokens + {request.max_tokens} max_tokens = "
                f"{n + request.max_tokens}, which exceeds the context window of {budget} tokens.",
                param="messages",
            )
        sampling.validate(request.sampling, self.vocab_size)

    def generate(self, request: GenerateRequest) -> Iterator[Event]:
        """Submit and iterate; cancels the request if the consumer stops early."""
        handle = self.submit(request)
        try:
            yield from handle
        finally:
            self.cancel(handle.id)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its stream ends with a ``cancelled`` finish."""
        self._inbox.put(("cancel", request_id))

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything and stop the thread."""
        if not self._done.is_set():
            self._inbox.put(("close", None))
            self._done.wait(timeout)

    @property
    def in_flight(self) -> int:
        return len(self._by_uid)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    # -- the worker thread --------------------------------------------------------

    def _run(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        eos = sorted(self.loaded.tokenizer.eos_token_ids)

        def new_generator() -> BatchGenerator:
            return BatchGenerator(
                self.loaded.model,
                stop_tokens=[[t] for t in eos],
                completion_batch_size=self.decode_batch,
                prefill_batch_size=self.decode_batch,
                prefill_step_size=self.prefill_step_size,
            )

        gen = new_generator()
        try:
            while not self._closed.is_set():
                idle = not self._by_uid and not self._pending
                self._drain_inbox(gen, block=idle)
                if self._closed.is_set():
                    break
                self._admit(gen)
                if not self._by_uid:
                    continue
                try:
                    prompt_responses, responses = gen.next()
                except Exception as e:  # a failed step must not kill the worker
                    log.exception("generation step failed on %s", self.loaded.id)
                    self._fail_all(EngineError(f"Generation failed: {e}."))
                    gen.close()
                    gen = new_generator()
                    continue
                for pr in prompt_responses:
                    if (active := self._by_uid.get(pr.uid)) is not None:
                        active.state = RequestState.DECODE if pr.end_of_prompt else RequestState.PREFILL
                for r in responses:
                    self._on_token(gen, r)
        finally:
            for active in [*self._pending, *self._by_uid.values()]:
                self._finish(active, FinishReason.CANCELLED)
            self._pending.clear()
            self._by_uid.clear()
            gen.close()
            mx.synchronize(gen.stream)  # no asynchronous work may outlive the thread
            del gen
            self._closed.set()
            self._done.set()

    def _drain_inbox(self, gen: Any, block: bool) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                handle: RequestHandle = payload
                tok = self.loaded.tokenizer
                active = _Active(handle, tok.detokenizer(), StopMatcher(handle.request.stop))
                self._pending.append(active)
                self._requests[handle.id] = active
            elif kind == "cancel":
                self._cancel(gen, payload)
            elif kind == "close":
                self._closed.set()
                return

    def _cancel(self, gen: Any, request_id: str) -> None:
        active = self._requests.get(request_id)
        if active is None:
            return
        if active.uid is None:
            self._pending.remove(active)
        else:
            gen.remove([active.uid])
        self._finish(active, FinishReason.CANCELLED)

    def _admit(self, gen: Any) -> None:
        while self._pending and len(self._by_uid) < self.decode_batch:
            active = self._pending.popleft()
            req = active.request
            try:
                (uid,) = gen.insert(
                    [list(req.prompt_tokens)],
                    max_tokens=[req.max_tokens],
                    samplers=[sampling.make_sampler(req.sampling)],
                    logits_processors=[sampling.make_processors(req.sampling)],
                )
            except Exception as e:
                self._finish(active, FinishReason.ERROR, EngineError(f"Cannot start request: {e}."))
                continue
            active.uid = uid
            active.state = RequestState.PREFILL
            self._by_uid[uid] = active

    def _on_token(self, gen: Any, r: Any) -> None:
        active = self._by_uid.get(r.uid)
        if active is None:
            return
        active.generated += 1
        if active.first_token_at is None:
            active.first_token_at = time.monotonic()
        active.state = RequestState.DECODE
        hit_eos = r.finish_reason == "stop"
        text = "" if hit_eos else active.detok.add(r.token)
        if r.finish_reason is not None:
            text += active.detok.flush()
        text, hit_stop = active.stops.feed(text)
        finish: FinishReason | None = None
        if hit_stop:
            finish = FinishReason.STOP
            if r.finish_reason is None:
                gen.remove([r.uid])
        elif r.finish_reason is not None:
            text += active.stops.flush()
            finish = FinishReason.STOP if hit_eos else FinishReason.LENGTH
        token_ids = () if hit_eos else (r.token,)
        if text or token_ids:
            active.handle._emit(Event(active.handle.id, text=text, token_ids=token_ids))
        if finish is not None:
            self._finish(active, finish)

    def _finish(
        self, active: _Active, reason: FinishReason, error: GmlxError | None = None
    ) -> None:
        active.state = RequestState.FINISHED
        if active.uid is not None:
            self._by_uid.pop(active.uid, None)
        self._requests.pop(active.handle.id, None)
        usage = Usage(len(active.request.prompt_tokens), active.generated)
        active.handle._emit(
            Event(active.handle.id, finish_reason=reason, usage=usage, error=error)
        )

    def _fail_all(self, error: GmlxError) -> None:
        for active in list(self._by_uid.values()):
            self._finish(active, FinishReason.ERROR, error)
