"""One worker thread per resident model: it owns MLX and steps the model's batch.

Front ends call :meth:`ModelWorker.submit` from any thread and consume the returned
:class:`RequestHandle`, synchronously (the CLI) or with ``async for`` (the server,
without blocking its event loop). All MLX work happens on the worker's thread; the
handle only moves :class:`Event` objects across.

The worker admits and queues requests, cancels them, applies the memory governor and
finishes requests (their statistics and final event). The rest is elsewhere: the
batch it steps (``batch``: mlx-lm's generator and the requests in it), the choices
it makes (``scheduling``), each request's token-to-text chain (``pipeline``), and
what it reads of mlx-lm's insides (``mlxlm``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from gmlx.engine import scheduling
from gmlx.engine.batch import Batch
from gmlx.engine.drafting import refuse_structured
from gmlx.engine.errors import EngineError, GmlxError, ServerOverloadedError
from gmlx.engine.governor import Governor, ShedError
from gmlx.engine.kv_quant import KVQuant
from gmlx.engine.loading import LoadedModel
from gmlx.engine.prompt_cache import PromptCache
from gmlx.engine.reasoning import thinking_markers
from gmlx.engine.requests import (
    ActiveRequest,
    RequestHandle,
    RequestState,
    check_request,
    metrics_rows,
)
from gmlx.engine.scheduling import DEFAULT_DECODE_BATCH, default_prefill_step
from gmlx.engine.stats import WorkerStats
from gmlx.engine.threads import run_then_park
from gmlx.engine.tools import tool_parser_for
from gmlx.engine.types import Event, FinishReason, GenerateRequest

__all__ = [
    "DEFAULT_DECODE_BATCH",
    "DEFAULT_PROMPT_CACHE_BYTES",
    "ModelWorker",
    "RequestHandle",
    "RequestState",
    "default_prefill_step",
]

log = logging.getLogger("gmlx.engine")

DEFAULT_PROMPT_CACHE_BYTES = 512 * 1024**2
MAX_RESTARTS = 5  # failures outside a request within RESTART_WINDOW_S before the worker stops
RESTART_WINDOW_S = 60.0


# Workers still running at interpreter exit are closed first: MLX aborts the process
# if its scheduler still holds a thread's asynchronous work during finalization.
_live_workers: weakref.WeakSet[ModelWorker] = weakref.WeakSet()


@atexit.register
def _close_live_workers() -> None:
    for worker in list(_live_workers):
        worker.close()


def _canceller(inbox: queue.SimpleQueue[tuple[str, Any]]) -> Callable[[str], None]:
    """What a handle cancels with: it reaches the worker's inbox, never the worker
    (a handle kept after its model is unloaded holds nothing of it)."""

    def cancel(request_id: str) -> None:
        inbox.put(("cancel", request_id))

    return cancel


class ModelWorker:
    """Runs one loaded model on its own thread with continuous batching.

    Args:
        loaded: the model and tokenizer.
        decode_batch: how many requests decode together; the rest wait in FIFO order.
        prefill_step_size: prompt tokens processed per step, so a long prompt does
            not stall the streams already decoding.
        queue_cap: most requests waiting for a slot; one more is refused with
            ServerOverloadedError (default: 4 x decode_batch).
        prompt_cache_bytes: bound of the prefix cache (0 turns it off).
        buffer_cache_bytes: how much of MLX's buffer cache the worker keeps across
            prefill chunks (``gmlx.engine.buffers``); None empties it after every
            chunk, as mlx-lm does.
        kv_quant: the KV quantization of the model's caches (None: full precision).
        speculation: the model's drafting (``gmlx.engine.speculative.Speculation``),
            or None: without it every step decodes one token per stream.
        governor: the memory governor shared by the server's workers; in orange
            no new prefill starts, in red the largest running request is shed.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        decode_batch: int = DEFAULT_DECODE_BATCH,
        prefill_step_size: int | None = None,
        queue_cap: int | None = None,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        governor: Governor | None = None,
        buffer_cache_bytes: int | None = None,
        kv_quant: KVQuant | None = None,
        speculation: Any = None,
    ) -> None:
        if decode_batch < 1:
            raise ValueError("decode_batch must be >= 1")
        self.loaded = loaded
        self.decode_batch = decode_batch
        self.prefill_step_size = prefill_step_size or default_prefill_step()
        self.queue_cap = 4 * decode_batch if queue_cap is None else max(0, queue_cap)
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.governor = governor
        self.buffer_cache_bytes = buffer_cache_bytes
        self.stats = WorkerStats()
        self._admission = threading.Lock()
        self._waiting = 0  # submitted, not yet given a slot (guarded by _admission)
        self.vocab_size = int(loaded.config.get("vocab_size") or len(loaded.tokenizer))
        self.tool_parser = tool_parser_for(loaded.tokenizer)
        self.think_markers = thinking_markers(loaded.tokenizer)  # (start, end), or None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._cancel_request = _canceller(self._inbox)
        self._pending: deque[ActiveRequest] = deque()
        self._batch = Batch(loaded, width=decode_batch, prefill_step_size=self.prefill_step_size,
                            prompt_cache=self.prompt_cache, kv_quant=kv_quant,
                            speculation=speculation)
        self.speculation = speculation  # drafting (``gmlx.engine.speculative``), or None
        self._requests: dict[str, ActiveRequest] = {}
        self._closed = threading.Event()
        self._done = threading.Event()
        self.restarts = 0  # times the loop failed outside a request and started again
        self._restarts: list[float] = []  # when, within the last RESTART_WINDOW_S
        self._close_error: str | None = None  # why requests end when the worker stops
        self._thread = threading.Thread(
            target=run_then_park, args=([self._run],), name=f"gmlx-worker-{loaded.id}", daemon=True
        )
        self._thread.start()
        _live_workers.add(self)

    # -- front-end API (any thread) ---------------------------------------------

    def submit(self, request: GenerateRequest) -> RequestHandle:
        """Validate and queue a request. Raises GmlxError for a request that cannot run."""
        check_request(request, self.vocab_size, self.loaded.context_length)
        if self.speculation is not None:
            refuse_structured(self.loaded.id, request.grammar)
        if self._closed.is_set():
            raise EngineError(f"The worker for {self.loaded.id} is shut down.")
        with self._admission:
            if scheduling.queue_full(self.waiting_for_slot, self.queue_cap, self.free_slots):
                retry = scheduling.retry_after_s(self.queue_eta_s())
                reason = f"the queue is full ({self.queued} waiting, cap {self.queue_cap})"
                self.stats.rejections += 1
                self.stats.last_reject_reason = reason
                raise ServerOverloadedError(
                    f"Server overloaded: {reason}; retry in {retry} s.",
                    headers={"Retry-After": str(retry)},
                )
            self._waiting += 1
        handle = RequestHandle(request, self._cancel_request)
        active = ActiveRequest.prepare(handle, self.loaded.tokenizer,
                                       think_markers=self.think_markers, tool_parser=self.tool_parser)
        self._requests[handle.id] = active  # visible to has_request/cancel at once
        self._inbox.put(("submit", active))
        return handle

    @property
    def waiting_for_slot(self) -> int:
        """Requests submitted and not yet given a slot, counted from the moment
        ``submit`` returns (those still in the inbox too): what admission control and
        the time-to-first-token estimate count ahead of a new request."""
        return self._waiting

    @property
    def free_slots(self) -> int:
        return self._batch.free

    @property
    def kv_quant(self) -> KVQuant | None:
        """The KV quantization its caches apply, or None (full precision)."""
        return self._batch.kv_quant

    @property
    def queued(self) -> int:
        """Requests waiting beyond the free slots (those are about to start)."""
        return scheduling.queued(self._waiting, self.free_slots)

    def queue_eta_s(self) -> float:
        """Seconds until the queue drains at the recent pace (0 when nothing waits)."""
        return scheduling.queue_eta_s(self.queued, self.decode_batch, self.stats.mean_request_s())

    def warm_up(self, prefills: bool | None = None) -> float:
        """Run every decode width (and on an accelerator the prefill shapes) once before
        the first client does; the model is not ready until this ends
        (``gmlx.engine.warmup`` says what and why). Returns the seconds it took."""
        from gmlx.engine.warmup import warm_up

        return warm_up(self, prefills)

    def generate(self, request: GenerateRequest) -> Iterator[Event]:
        """Submit and iterate; cancels the request if the consumer stops early."""
        handle = self.submit(request)
        try:
            yield from handle
        finally:
            self.cancel(handle.id)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its stream ends with a ``cancelled`` finish."""
        self._cancel_request(request_id)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still queued or running end with an
        ``engine_error`` (an unfinished answer is never reported as finished)."""
        if not self._done.is_set():
            self._close_error = self._close_error or f"the worker for {self.loaded.id} closed"
            self._inbox.put(("close", None))
            self._done.wait(timeout)

    def abort(self, error: GmlxError) -> None:
        """End every queued and running request with ``error`` at the next step (a
        server shutting down); the worker serves on."""
        self._inbox.put(("abort", error))

    @property
    def alive(self) -> bool:
        """Whether the worker still takes requests."""
        return not self._closed.is_set()

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (measured once)."""
        from gmlx.engine.capacity import weight_bytes

        return weight_bytes(self.loaded.model)

    @property
    def in_flight(self) -> int:
        return len(self._batch.running)

    def rows(self) -> list[dict[str, Any]]:
        """One metrics row per live request, queued ones first (in queue order)."""
        return metrics_rows(list(self._requests.values()), self.loaded.id, time.monotonic())

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def waiting(self) -> int:
        """Requests the worker holds in its queue: no slot was free, or the governor
        holds new prefills back. What metrics, health and status report; unlike
        ``waiting_for_slot`` it never counts a request that is about to take a free
        slot (still in the inbox), which would read as a queue for a moment."""
        return len(self._pending)

    # -- the worker thread --------------------------------------------------------

    def _run(self) -> None:
        if self.buffer_cache_bytes is not None:
            from gmlx.engine.buffers import keep_buffers

            keep_buffers(self.buffer_cache_bytes)
        batch = self._batch
        batch.open()
        try:
            while not self._closed.is_set():
                try:
                    self._loop(batch)
                except Exception as e:  # noqa: BLE001 - outside any one request: restart
                    self._restart(e)
        finally:
            self._closed.set()
            while True:  # requests submitted while closing end too, never hang
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._pending.append(payload)
            self._end_all(self._close_error)
            batch.close()
            self._closed.set()
            self._done.set()

    def _loop(self, batch: Batch) -> None:
        while not self._closed.is_set():
            idle = not batch.running and not self._pending
            self._drain_inbox(block=idle)
            if self._closed.is_set():
                break
            if self._govern():
                self._admit()
            if not batch.running:
                if self._pending:  # held back by the governor: wait, do not spin
                    self._drain_inbox(block=True, timeout=0.05)
                continue
            for active, reason, error in batch.step(self.stats):
                self._finish(active, reason, error)

    def _restart(self, error: Exception) -> None:
        """The loop failed outside any one request: end the requests in flight with an
        ``engine_error``, start a fresh generator, and serve on. A worker that keeps
        failing (``MAX_RESTARTS`` within ``RESTART_WINDOW_S``) stops instead: its
        requests end with the error and later ones are refused."""
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
        self.restarts += 1
        log.error("the worker for %s failed (%r); restarting it", self.loaded.id, error, exc_info=error)
        if len(self._restarts) > MAX_RESTARTS:
            log.error("the worker for %s failed %d times in %.0f s; stopping it",
                      self.loaded.id, len(self._restarts), RESTART_WINDOW_S)
            self._close_error = f"its worker failed repeatedly ({error})"
            self._closed.set()
            return
        self._end_all(f"its worker failed ({error}) and was restarted")
        try:
            self._batch.reset()
        except Exception as e:  # no generator to serve with: stop
            log.exception("cannot restart the worker for %s", self.loaded.id)
            self._close_error = f"its worker failed and could not restart ({e})"
            self._closed.set()

    def _end_all(self, why: str | GmlxError | None) -> None:
        """End every queued and running request: ``cancelled`` (``why`` None), with
        ``why`` (a typed error), or with an ``engine_error`` whose message is ``why``
        completed with each request's id."""
        live = [*self._pending, *self._batch.running.values()]
        with self._admission:
            self._waiting -= len(self._pending)
        self._pending.clear()
        for active in live:
            if why is None:
                self._finish(active, FinishReason.CANCELLED)
            else:
                error = why if isinstance(why, GmlxError) else EngineError(
                    f"Request {active.request.id} ended: {why}.")
                self._finish(active, FinishReason.ERROR, error)
        self._batch.running.clear()

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                if payload.state is RequestState.QUEUED:  # not cancelled meanwhile
                    self._pending.append(payload)
            elif kind == "cancel":
                self._cancel(payload)
            elif kind == "abort":
                self._end_all(payload)
                self._batch.reset()
            elif kind == "close":
                self._closed.set()
                return

    def _cancel(self, request_id: str) -> None:
        active = self._requests.get(request_id)
        if active is None:
            return
        if active.uid is None:
            self._pending.remove(active)
            with self._admission:
                self._waiting -= 1
        else:
            self._batch.remove(active)
        self._finish(active, FinishReason.CANCELLED)

    def _admit(self) -> None:
        while self._pending and self._batch.free:
            active = self._pending.popleft()
            with self._admission:
                self._waiting -= 1
            try:
                self._batch.admit(active)
            except Exception as e:
                log.exception("cannot start request %s", active.request.id)
                self._finish(active, FinishReason.ERROR, EngineError(f"Cannot start request: {e}."))

    def _govern(self) -> bool:
        """Apply the governor's band; returns whether new prefills may start."""
        gov = self.governor
        if gov is None:
            return True
        gov.update()
        victim = scheduling.shed_victim(self._batch.running.values()) if gov.claim_shed() else None
        if victim is not None:
            tokens = victim.tokens_held
            self._batch.remove(victim, keep_kv=False)
            log.warning("governor shed %s (%d tokens) at headroom %s bytes", victim.request.id, tokens,
                        gov.headroom_bytes)
            self._finish(victim, FinishReason.SHED, ShedError(
                f"Request shed to keep the server within memory: it held {tokens} tokens and "
                f"headroom fell to {gov.headroom_bytes} bytes (floor {gov.floor_bytes}).",
                headers={"Retry-After": "10"},
            ))
        return gov.admits_prefill

    def _finish(
        self, active: ActiveRequest, reason: FinishReason, error: GmlxError | None = None
    ) -> None:
        """End a request: forget it, count it, and send its final event."""
        if active.uid is not None:
            self._batch.running.pop(active.uid, None)
        self._requests.pop(active.handle.id, None)
        self.stats.record(active, reason)  # before the final event: its reader sees it
        active.finish(reason, error)
