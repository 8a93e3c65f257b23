"""One worker thread per resident model: it owns MLX and runs mlx-lm's BatchGenerator.

Front ends call :meth:`ModelWorker.submit` from any thread and consume the returned
:class:`RequestHandle`, synchronously (the CLI) or with ``async for`` (the server,
without blocking its event loop). All MLX work happens on the worker's thread; the
handle only moves :class:`Event` objects across.
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from gmlx.engine import sampling
from gmlx.engine.errors import (
    EngineError,
    GmlxError,
    InvalidRequestError,
    PromptTooLongError,
    ServerOverloadedError,
)
from gmlx.engine.governor import Governor, ShedError
from gmlx.engine.loading import LoadedModel
from gmlx.engine.prompt_cache import PromptCache, with_room
from gmlx.engine.reasoning import (
    ReasoningSplitter,
    detect_open_think,
    make_thinking_budget_processor,
    thinking_markers,
)
from gmlx.engine.requests import ActiveRequest, RequestHandle, RequestState
from gmlx.engine.stats import WorkerStats, token_logprobs
from gmlx.engine.structured import make_grammar_processor
from gmlx.engine.tokenizer import StopMatcher
from gmlx.engine.tools import ToolCall, ToolCallStream, tool_parser_for
from gmlx.engine.types import Event, FinishReason, GenerateRequest, SamplingParams, Usage

__all__ = ["ModelWorker", "RequestHandle", "RequestState"]

log = logging.getLogger("gmlx.engine")

DEFAULT_DECODE_BATCH = 8
DEFAULT_PREFILL_STEP = 512  # CPU: unfused attention makes the chunk's transient large
DEFAULT_PROMPT_CACHE_BYTES = 512 * 1024**2
RETRY_AFTER_RANGE = (2, 60)
WARMUP_MAX_WIDTH = 32  # wider batches compile their shapes on first use
MIN_SHARED_PREFILL_STEP = 64  # the smallest prefill chunk while streams decode


def default_prefill_step() -> int:
    """Prompt tokens per prefill step: 512 on the CPU, 2048 where attention is fused
    (Metal, CUDA), so its transient stays small and fewer, larger steps win."""
    from gmlx.engine.capacity import backend

    return DEFAULT_PREFILL_STEP if backend() == "cpu" else 2048


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


@dataclass
class _FirstToken:
    """A first token handed out early, shaped as mlx-lm's generation response."""

    uid: int
    token: int
    logprobs: Any
    finish_reason: None = None
    prompt_cache: None = None
    all_tokens: None = None


def _unchanged_logits(tokens: Any, logits: Any) -> Any:
    return logits


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
        tok = loaded.tokenizer
        self.tool_parser = tool_parser_for(tok)
        self._think_markers = thinking_markers(tok)
        # Tokens XTC never excludes: ending or breaking a line must stay possible.
        self._protected_ids = sorted(tok.eos_token_ids | set(tok.encode("\n", add_special_tokens=False)))
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending: deque[ActiveRequest] = deque()
        self._by_uid: dict[int, ActiveRequest] = {}
        self._requests: dict[str, ActiveRequest] = {}
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
        with self._admission:
            if self.waiting_for_slot >= self.queue_cap + self.free_slots:
                eta = self.queue_eta_s()
                retry = min(max(round(eta), RETRY_AFTER_RANGE[0]), RETRY_AFTER_RANGE[1])
                reason = f"the queue is full ({self.queued} waiting, cap {self.queue_cap})"
                self.stats.rejections += 1
                self.stats.last_reject_reason = reason
                raise ServerOverloadedError(
                    f"Server overloaded: {reason}; retry in {retry} s.",
                    headers={"Retry-After": str(retry)},
                )
            self._waiting += 1
        handle = RequestHandle(request, self)
        active = self._prepare(handle)
        self._requests[handle.id] = active  # visible to has_request/cancel at once
        self._inbox.put(("submit", active))
        return handle

    def _prepare(self, handle: RequestHandle) -> ActiveRequest:
        """The per-request state: detokenizer, stop matcher, logits processors (grammar,
        thinking budget, penalties) and the reasoning and tool-call splitters."""
        req, tok = handle.request, self.loaded.tokenizer
        active = ActiveRequest(handle, tok.detokenizer(), StopMatcher(req.stop))
        inside = None
        if self._think_markers and (req.split_reasoning or req.thinking_budget is not None):
            tail = tok.decode(list(req.prompt_tokens[-16:]))
            inside = detect_open_think(tail, self._think_markers[0])
            if req.split_reasoning:
                active.splitter = ReasoningSplitter(*self._think_markers, starts_inside=inside)
        active.processors = sampling.make_processors(req.sampling)
        if budget := make_thinking_budget_processor(tok, req.thinking_budget, inside):
            active.processors.append(budget)
        if grammar := make_grammar_processor(tok, req.grammar):
            active.processors.append(grammar)
        if req.tools and self.tool_parser is not None:
            active.tool_stream = ToolCallStream(self.tool_parser, req.tools)
        return active

    @property
    def waiting_for_slot(self) -> int:
        """Requests submitted and not yet given a slot, counted from the moment
        ``submit`` returns (those still in the inbox too): what admission control and
        the time-to-first-token estimate count ahead of a new request."""
        return self._waiting

    @property
    def free_slots(self) -> int:
        return max(0, self.decode_batch - len(self._by_uid))

    @property
    def queued(self) -> int:
        """Requests waiting beyond the free slots (those are about to start)."""
        return max(0, self._waiting - self.free_slots)

    def queue_eta_s(self) -> float:
        """Seconds until the queue drains at the recent pace (0 when nothing waits)."""
        queued = self.queued
        if queued == 0:
            return 0.0
        per_request = self.stats.mean_request_s() or 5.0
        return per_request * -(-queued // self.decode_batch)

    def validate(self, request: GenerateRequest) -> None:
        n = len(request.prompt_tokens)
        if n == 0:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
        if min(request.prompt_tokens) < 0 or max(request.prompt_tokens) >= self.vocab_size:
            raise InvalidRequestError("The prompt holds a token id outside the vocabulary.")
        budget = self.loaded.context_length
        if n + request.max_tokens > budget:
            raise PromptTooLongError(
                f"prompt is too long: {n} prompt tokens + {request.max_tokens} max_tokens = "
                f"{n + request.max_tokens}, which exceeds the context window of {budget} tokens.",
                param="messages",
            )
        sampling.validate(request.sampling, self.vocab_size)

    def warm_up(self) -> float:
        """Run every decode-batch width once, before the first client does: on an
        accelerator each new shape of a step compiles its kernels on first use (up to
        seconds), which would otherwise land in some client's time to first token.

        ``decode_batch`` short requests (at most ``WARMUP_MAX_WIDTH``) go in together.
        Each decodes past the admission of the last (however many prompts prefill
        together) and each asks for one token more than the one before, so they leave
        one by one and the batch passes through every width down to 1. The chat template
        is rendered once first (its compilation would also land in the first client's
        time). The prompt cache and the statistics are cleared afterwards. Returns the
        seconds it took.
        """
        started = time.monotonic()
        try:  # the chat template compiles on its first render (~10 ms on a CPU)
            self.loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello."}])
        except Exception as e:  # noqa: BLE001 - a real request will report it properly
            log.debug("%s: warm-up render failed: %r", self.loaded.id, e)
        n, vocab = min(self.decode_batch, WARMUP_MAX_WIDTH), self.vocab_size
        # Greedy, and never ending early: each must stay in the batch for the whole ramp.
        no_eos = {t: -100.0 for t in self.loaded.tokenizer.eos_token_ids}
        greedy = SamplingParams(temperature=0.0, logit_bias=no_eos)
        handles = [
            self.submit(GenerateRequest(
                tuple((97 * i + 31 * j + 1) % vocab for j in range(8)),
                max_tokens=2 * n + 2 + i,
                sampling=greedy,
                id=f"req-warmup-{i}",
            ))
            for i in range(n)
        ]
        for handle in handles:
            for _ in handle:
                pass
        self.prompt_cache.reset(stats=True)
        self.stats = WorkerStats()
        return time.monotonic() - started

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

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (measured once)."""
        from gmlx.engine.capacity import weight_bytes

        return weight_bytes(self.loaded.model)

    @property
    def in_flight(self) -> int:
        return len(self._by_uid)

    def rows(self) -> list[dict[str, Any]]:
        """One metrics row per live request, queued ones first (in queue order)."""
        now = time.monotonic()
        live = list(self._requests.values())
        queued = sorted((a for a in live if a.state is RequestState.QUEUED), key=lambda a: a.submitted_at)
        running = [a for a in live if a.state in (RequestState.PREFILL, RequestState.DECODE)]
        model = self.loaded.id
        return [a.row(model, i + 1, now) for i, a in enumerate(queued)] + [
            a.row(model, None, now) for a in running
        ]

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
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        eos = sorted(self.loaded.tokenizer.eos_token_ids)
        if self.buffer_cache_bytes is not None:
            from gmlx.engine.buffers import keep_buffers

            keep_buffers(self.buffer_cache_bytes)

        def new_generator() -> BatchGenerator:
            return BatchGenerator(
                self.loaded.model,
                stop_tokens=[[t] for t in eos],
                completion_batch_size=self.decode_batch,
                # Prompts prefill in chunks between decode steps; how many share a step
                # is set before each step (`_prefill_width`): the capacity model prices
                # one chunk's transient, and a burst of long prompts must not multiply it.
                prefill_batch_size=1,
                prefill_step_size=self.prefill_step_size,
            )

        gen = new_generator()
        try:
            while not self._closed.is_set():
                idle = not self._by_uid and not self._pending
                self._drain_inbox(gen, block=idle)
                if self._closed.is_set():
                    break
                if self._govern(gen):
                    self._admit(gen)
                if not self._by_uid:
                    if self._pending:  # held back by the governor: wait, do not spin
                        self._drain_inbox(gen, block=True, timeout=0.05)
                    continue
                gen.prefill_step_size = step = self._prefill_step()
                gen.prefill_batch_size = self._prefill_width(gen, step)
                try:
                    prompt_responses, responses = gen.next()
                except Exception as e:  # a failed step must not kill the worker
                    log.exception("generation step failed on %s", self.loaded.id)
                    self._fail_all(EngineError(f"Generation failed: {e}."))
                    gen.close()
                    gen = new_generator()
                    continue
                started = []
                for pr in prompt_responses:
                    if (active := self._by_uid.get(pr.uid)) is not None:
                        active.state = RequestState.DECODE if pr.end_of_prompt else RequestState.PREFILL
                        if pr.end_of_prompt:
                            started.append(active)
                self.stats.note_step(len(responses))
                for r in responses:
                    self._on_token(gen, r)
                if started:
                    self._hand_out_first_tokens(gen, started)
                self._drop_failed(gen)
        finally:
            self._closed.set()
            while True:  # requests submitted while closing end too, never hang
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._pending.append(payload)
            for active in [*self._pending, *self._by_uid.values()]:
                self._finish(active, FinishReason.CANCELLED)
            with self._admission:
                self._waiting -= len(self._pending)
            self._pending.clear()
            self._by_uid.clear()
            gen.close()
            mx.synchronize(gen.stream)  # no asynchronous work may outlive the thread
            del gen
            self._closed.set()
            self._done.set()

    def _drain_inbox(self, gen: Any, block: bool, timeout: float | None = None) -> None:
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
            with self._admission:
                self._waiting -= 1
        else:
            self._remove(gen, active.uid)
        self._finish(active, FinishReason.CANCELLED)

    def _admit(self, gen: Any) -> None:
        while self._pending and len(self._by_uid) < self.decode_batch:
            active = self._pending.popleft()
            with self._admission:
                self._waiting -= 1
            req = active.request
            prompt = list(req.prompt_tokens)
            try:
                sampler = sampling.make_sampler(req.sampling, self._protected_ids)
                lookup = self.prompt_cache.fetch(prompt)
                cache = lookup.cache
                if cache is None:  # a miss merges like a hit (whole-step arrays, `with_room`)
                    cache = with_room(make_prompt_cache(self.loaded.model), len(lookup.rest))
                (uid,) = gen.insert(
                    [lookup.rest],
                    max_tokens=[req.max_tokens],
                    caches=[cache],
                    all_tokens=[prompt[: lookup.warm_tokens]],
                    # Greedy requests share one sampler (one batched call); it cannot fail.
                    samplers=[sampler if sampler is sampling.greedy_sampler
                              else self._guard(active, sampler, sampling.greedy_sampler)],
                    logits_processors=[
                        [self._guard(active, p, _unchanged_logits) for p in active.processors]
                    ],
                )
            except Exception as e:
                log.exception("cannot start request %s", req.id)
                self._finish(active, FinishReason.ERROR, EngineError(f"Cannot start request: {e}."))
                continue
            active.uid = uid
            active.state = RequestState.PREFILL
            active.admitted_at = time.monotonic()
            active.cache_tier, active.warm_tokens = lookup.tier, lookup.warm_tokens
            self._by_uid[uid] = active

    # A request's own sampler and logits processors (a grammar, a penalty) run while
    # the batch's next step is built. One that raises must fail that request alone: the
    # guard records the error and stands in a harmless result, so the step goes on for
    # the others, and the request leaves the batch after it (`_drop_failed`).

    @staticmethod
    def _guard(active: ActiveRequest, fn: Any, stand_in: Any) -> Any:
        def guarded(*args: Any) -> Any:
            if active.failure is None:
                try:
                    return fn(*args)
                except Exception as e:  # noqa: BLE001 - the request ends with it
                    active.failure = e
            return stand_in(*args)

        return guarded

    def _drop_failed(self, gen: Any) -> None:
        for active in [a for a in self._by_uid.values() if a.failure is not None]:
            log.error("request %s failed: %r", active.request.id, active.failure)
            self._remove(gen, active.uid, keep_kv=False)  # type: ignore[arg-type]
            self._finish(active, FinishReason.ERROR, EngineError(f"Generation failed: {active.failure}."))

    def _prefill_step(self) -> int:
        """Prompt tokens one step may prefill. While streams are decoding, a quarter of
        ``prefill_step_size``: every step waits for its prefill chunk, so a long prompt
        arriving in full chunks would hold each running stream's next token for a whole
        chunk (a 512-token chunk at a 2k context takes ~250 ms on a 2-core CPU). With
        nobody decoding the whole chunk goes, for the fastest prefill."""
        if any(a.state is RequestState.DECODE for a in self._by_uid.values()):
            return max(MIN_SHARED_PREFILL_STEP, self.prefill_step_size // 4)
        return self.prefill_step_size

    def _prefill_width(self, gen: Any, step: int) -> int:
        """How many prompts prefill together in the next step: in arrival order, as many
        as keep that step within ``step`` tokens counting each at the longest one's
        chunk (the batch is padded to it). A burst of short prompts then prefills in one
        step instead of one step each, while the memory a prefill step takes stays
        within what the capacity model prices for one chunk. At least one."""
        chunks = [min(len(seq[0][0]), step) for seq in gen._currently_processing if seq[0]]
        chunks += [min(len(seq[1][0]), step) for seq in gen._unprocessed_sequences]
        width = longest = 0
        for chunk in chunks:
            wider = max(longest, chunk)
            if width and (width + 1) * wider > step:
                break
            width, longest = width + 1, wider
        return max(1, width)

    def _remove(self, gen: Any, uid: int, keep_kv: bool = True) -> None:
        """Take a running request out of the batch, keeping its KV in the prompt cache."""
        for cache, tokens in gen.remove([uid], return_prompt_caches=keep_kv).values():
            self.prompt_cache.insert(tokens, cache)

    def _govern(self, gen: Any) -> bool:
        """Apply the governor's band; returns whether new prefills may start."""
        gov = self.governor
        if gov is None:
            return True
        gov.update()
        if gov.claim_shed() and self._by_uid:
            victim = max(self._by_uid.values(), key=lambda a: len(a.request.prompt_tokens) + a.generated)
            self._remove(gen, victim.uid, keep_kv=False)  # type: ignore[arg-type]
            tokens = len(victim.request.prompt_tokens) + victim.generated
            log.warning("governor shed %s (%d tokens) at headroom %s bytes", victim.request.id, tokens,
                        gov.headroom_bytes)
            self._finish(victim, FinishReason.SHED, ShedError(
                f"Request shed to keep the server within memory: it held {tokens} tokens and "
                f"headroom fell to {gov.headroom_bytes} bytes (floor {gov.floor_bytes}).",
                headers={"Retry-After": "10"},
            ))
        return gov.admits_prefill

    def _hand_out_first_tokens(self, gen: Any, started: list[ActiveRequest]) -> None:
        """Hand out the first token of requests whose prompt just finished, now.

        mlx-lm computes a request's first token in the step that ends its prompt but
        returns it only from the next step, after building that step's graph: the
        first token waits for one more graph (on a CPU, where building overlaps
        nothing, the whole next step: a 2k-token prefix hit's first token came after
        18.4 ms, now 16.7; on an H200 timeline that graph took ~10 ms of a 46 ms hit).
        On an accelerator, reading it here costs the running streams that one overlap,
        once per admission. Left to mlx-lm: a token that ends the request (an
        end-of-sequence token, or the only one asked for), so its ending stays mlx-lm's."""
        import mlx.core as mx

        batch = gen._generation_batch
        for active in started:
            if active.request.max_tokens <= 1 or active.uid not in batch.uids:
                continue
            row = batch.uids.index(active.uid)
            try:
                with mx.stream(gen.stream):  # on the generator's stream: no cross-stream wait
                    token = batch._next_tokens[row].item()
            except Exception:  # mlx-lm's own step will hand it out (or fail it)
                log.exception("reading the first token of %s early failed", active.request.id)
                continue
            if token in self.loaded.tokenizer.eos_token_ids:
                continue
            self._on_token(gen, _FirstToken(active.uid, token, batch._next_logprobs[row]))
            active.handed_out = token

    def _on_token(self, gen: Any, r: Any) -> None:
        active = self._by_uid.get(r.uid)
        if active is None:
            return
        # mlx-lm returning a first token handed out already (`_hand_out_first_tokens`):
        # nothing to do, unless it also ended the request (never, as that path stands).
        again = active.handed_out is not None
        active.handed_out = None
        if again and r.finish_reason is None:
            return
        if not again:
            active.generated += 1
        if active.first_token_at is None:
            active.first_token_at = time.monotonic()
        active.state = RequestState.DECODE
        hit_eos = r.finish_reason == "stop"
        text = "" if hit_eos or again else active.detok.add(r.token)
        if r.finish_reason is not None:
            text += active.detok.flush()
        text, hit_stop = active.stops.feed(text)
        finish: FinishReason | None = None
        if hit_stop:
            finish = FinishReason.STOP
            if r.finish_reason is None:
                self._remove(gen, r.uid)
        elif r.finish_reason is not None:
            text += active.stops.flush()
            finish = FinishReason.STOP if hit_eos else FinishReason.LENGTH
        if r.finish_reason is not None and r.prompt_cache is not None:
            self.prompt_cache.insert(r.all_tokens, r.prompt_cache)
        reasoning, text, calls = self._split(active, text, final=finish is not None)
        if finish is FinishReason.STOP and active.tool_stream and active.tool_stream.calls:
            finish = FinishReason.TOOL_CALLS
        token_ids = () if hit_eos or again else (r.token,)
        if text or reasoning or calls or token_ids:
            logprob, top = token_logprobs(r, active.request) if token_ids else (None, ())
            active.handle._emit(Event(
                active.handle.id, text=text, token_ids=token_ids, reasoning=reasoning,
                tool_calls=calls, logprob=logprob, top_logprobs=top,
            ))
        if finish is not None:
            if active.request.tool_choice_forced and not (active.tool_stream and active.tool_stream.calls):
                log.warning("%s: a tool call was required but the model made none", active.request.id)
            self._finish(active, finish)

    @staticmethod
    def _split(active: ActiveRequest, text: str, final: bool) -> tuple[str, str, tuple[ToolCall, ...]]:
        """Route released text: thinking-block text to reasoning, tool calls out of the
        content; ``final`` flushes whatever the splitters hold."""
        reasoning = ""
        if active.splitter is not None:
            reasoning, text = active.splitter.feed(text)
            if final:
                more_reasoning, more_text = active.splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if active.tool_stream is None:
            return reasoning, text, ()
        items = active.tool_stream.feed(text) + (active.tool_stream.finish() if final else [])
        content = "".join(i for i in items if isinstance(i, str))
        return reasoning, content, tuple(i for i in items if isinstance(i, ToolCall))

    def _finish(
        self, active: ActiveRequest, reason: FinishReason, error: GmlxError | None = None
    ) -> None:
        active.state = RequestState.FINISHED
        if active.uid is not None:
            self._by_uid.pop(active.uid, None)
        self._requests.pop(active.handle.id, None)
        self.stats.record(active, reason)
        usage = Usage(len(active.request.prompt_tokens), active.generated, active.warm_tokens)
        active.handle._emit(
            Event(
                active.handle.id,
                finish_reason=reason,
                usage=usage,
                error=error,
                stop_sequence=active.stops.matched,
                cache_tier=active.cache_tier,
            )
        )

    def _fail_all(self, error: GmlxError) -> None:
        for active in list(self._by_uid.values()):
            self._finish(active, FinishReason.ERROR, error)
