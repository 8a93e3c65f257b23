"""The running batch of one model: mlx-lm's BatchGenerator and the requests in it.

A model worker admits requests into its batch and steps it. The batch starts each
request from the longest cached prefix, sets each step's prefill chunk and width
(``gmlx.engine.scheduling``), hands every token the generator returns to its
request's pipeline, and leaves the KV of requests that leave in the prompt cache.
A step returns the requests it ended (their output ended, their own sampler failed,
the step failed) for the worker to finish. Everything runs on the worker's thread;
``running`` and ``free`` may be read from any.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gmlx.engine import handover, mlxlm, scheduling, step_times
from gmlx.engine.errors import EngineError, GmlxError
from gmlx.engine.kv_layers import make_cache
from gmlx.engine.kv_quant import KVQuant
from gmlx.engine.loading import LoadedModel
from gmlx.engine.prompt_cache import PromptCache, with_room
from gmlx.engine.requests import ActiveRequest, RequestState
from gmlx.engine.stats import WorkerStats
from gmlx.engine.types import FinishReason

log = logging.getLogger("gmlx.engine")

Ended = tuple[ActiveRequest, FinishReason, GmlxError | None]  # a request, why, and the error


class Batch:
    """The requests decoding together on one model, at most ``width`` of them.

    Args:
        loaded: the model and tokenizer.
        width: the decode batch.
        prefill_step_size: prompt tokens a step prefills while nothing decodes.
        prompt_cache: where requests start from and leave their KV.
        kv_quant: the KV quantization of the model's caches (None: full precision).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        width: int,
        prefill_step_size: int,
        prompt_cache: PromptCache,
        kv_quant: KVQuant | None = None,
        speculation: Any = None,
    ) -> None:
        self.loaded = loaded
        self.speculation = speculation  # drafting (``gmlx.engine.speculative``), or None
        self.kv_quant = kv_quant
        self.width = width
        self.prefill_step_size = prefill_step_size
        self.prompt_cache = prompt_cache
        self.running: dict[int, ActiveRequest] = {}  # by the generator's uid
        self._ended: list[Ended] = []  # what the current step ended (one list, reused)
        tok = loaded.tokenizer
        # Tokens XTC never excludes: ending or breaking a line must stay possible.
        self._protected_ids = sorted(tok.eos_token_ids | set(tok.encode("\n", add_special_tokens=False)))
        self._gen: Any = None
        self._handover: handover.HandOver | None = None  # GMLX_HANDOVER_LAYERS (gmlx.engine.handover)
        # image requests being prefilled from embeddings, by their (negative) uid
        self._staged: dict[int, tuple[Any, Any]] = {}
        self._staged_uid = 0
        self.step_times = step_times.from_env()  # the decode steps' phases (GMLX_STEP_TIMES), or None

    @property
    def free(self) -> int:
        """Slots no request holds."""
        return max(0, self.width - len(self.running))

    def new_cache(self) -> list[Any]:
        """A fresh cache for one request (its KV layers quantized under ``kv_quant``)."""
        return make_cache(self.loaded, self.kv_quant)

    def open(self) -> None:
        """Start mlx-lm's generator, on the thread that steps it."""
        if self._handover is None and (every := handover.layers_per_chunk()):
            self._handover = handover.attach(self.loaded.model, every)
        # Prompts prefill in chunks between decode steps; how many share a step is set
        # before each step (`prefill_width`): the capacity model prices one chunk's
        # transient, and a burst of long prompts must not multiply it.
        self._gen = mlxlm.batch_generator(self.loaded.model, sorted(self.loaded.tokenizer.eos_token_ids),
                                          self.width, self.prefill_step_size,
                                          None if self._handover is None else self._handover.stream,
                                          self.step_times)
        if self.speculation is not None:  # decoding streams verify drafts in rounds
            mlxlm.use_generation_batch(self._gen, self.speculation.generation_batch(
                self.loaded.model, self._draft_policy, self.prefill_step_size))

    def _draft_policy(self, uid: int, has_processors: bool) -> Any:
        """How the stream ``uid`` drafts (``speculative.policy_for``); its counts go to
        its request's metrics row."""
        from gmlx.engine.drafting import SpecStats
        from gmlx.engine.speculative import PLAIN, policy_for

        if (active := self.running.get(uid)) is None:
            return PLAIN
        active.speculative = SpecStats()
        return policy_for(active.request.sampling, has_processors, active.speculative)

    def close(self) -> None:
        """Stop the generator and wait for its work: no asynchronous work may outlive
        the thread. The requests still running are forgotten (finish them first)."""
        import mlx.core as mx

        self.running.clear()
        self._staged.clear()
        gen, self._gen = self._gen, None
        gen.close()
        mx.synchronize(gen.stream)
        if self.step_times is not None:
            self.step_times.close()
        if self._handover is not None:
            handover.detach(self.loaded.model)
            self._handover = None

    def admit(self, active: ActiveRequest) -> None:
        """Start ``active`` from the longest cached prefix of its prompt; an image
        request whose images are not all cached is staged first (``_stage``). Raises
        what building its sampler or inserting it raises; the batch is unchanged then."""
        req = active.request
        prompt = list(req.prompt_tokens)
        sampler = active.guarded_sampler(self._protected_ids)
        if req.images:
            self._stage(active, prompt, sampler)
            return
        lookup = self.prompt_cache.fetch(prompt)
        self._insert(active, prompt, sampler, lookup.cache, lookup.warm_tokens)
        active.cache_tier, active.warm_tokens = lookup.tier, lookup.warm_tokens

    def _insert(self, active: ActiveRequest, prompt: list[int], sampler: Any,
                cache: list[Any] | None, warm: int) -> None:
        """Hand ``active`` to the generator with the KV of ``prompt[:warm]`` (None: none)."""
        req = active.request
        rest = prompt[warm:]
        if cache is None:  # a miss merges like a hit (whole-step arrays, `with_room`)
            cache = with_room(self.new_cache(), len(rest))
        (uid,) = self._gen.insert(
            [rest],
            max_tokens=[req.max_tokens],
            caches=[cache],
            all_tokens=[prompt[:warm]],
            samplers=[sampler],
            logits_processors=[active.guarded_processors()],
        )
        active.uid = uid
        active.state = RequestState.PREFILL
        active.admitted_at = active.admitted_at or time.monotonic()
        self.running[uid] = active

    def _stage(self, active: ActiveRequest, prompt: list[int], sampler: Any) -> None:
        """Start an image request: its longest cached prefix (keyed by its images'
        digests); if that ends before its last image, the rest up to it is staged, to
        be prefilled from embeddings a piece per step (``_advance_staged``) while the
        batch decodes. A staged request holds a slot in ``running`` under a negative
        uid of its own until it joins the generator."""
        from gmlx.engine.vision import prefill

        vision = self.loaded.vision
        if vision is None:  # the engine refuses images to a text model before this
            raise EngineError(f"{self.loaded.id} has no vision part to read the request's images.")
        images = active.request.images
        active.image_key = key = prefill.cache_key(vision, prompt, images)
        lookup = self.prompt_cache.fetch(key)
        active.cache_tier, active.warm_tokens = lookup.tier, lookup.warm_tokens
        end = prefill.images_end(vision, prompt)
        if lookup.warm_tokens >= end:
            self._insert(active, prompt, sampler, lookup.cache, lookup.warm_tokens)
            return
        cache = lookup.cache or self.new_cache()
        self._staged_uid -= 1
        active.uid = self._staged_uid
        active.state = RequestState.PREFILL
        active.admitted_at = time.monotonic()
        self.running[active.uid] = active
        self._staged[active.uid] = (prefill.stage(prompt, images, cache, lookup.warm_tokens, end),
                                    sampler)

    def _advance_staged(self, chunk: int) -> None:
        """One piece of the oldest staged image request's prefill; once its images are
        in its KV it joins the generator. A failure ends that request alone."""
        uid, (staged, sampler) = next(iter(self._staged.items()))
        active = self.running[uid]
        try:
            staged.advance(self.loaded.model, self.loaded.vision, chunk)
            if not staged.done:
                return
            del self._staged[uid], self.running[uid]
            cache = with_room(staged.cache, len(staged.prompt) - staged.end)
            self._insert(active, staged.prompt, sampler, cache, staged.end)
        except Exception as e:  # this request's images or prefill: not the batch's
            log.exception("prefilling the images of %s failed", active.request.id)
            self._staged.pop(uid, None)
            self._end(active, FinishReason.ERROR, EngineError(f"Prefilling the images failed: {e}."))

    def remove(self, active: ActiveRequest, keep_kv: bool = True) -> None:
        """Take a running request out of the generator, keeping its KV in the prompt
        cache (unless not ``keep_kv``). It stays in ``running`` until finished."""
        if self._staged.pop(active.uid, None) is not None:  # type: ignore[arg-type]
            return  # staged: not in the generator yet, and its partial KV is not kept
        for cache, tokens in self._gen.remove([active.uid], return_prompt_caches=keep_kv).values():
            self.prompt_cache.insert(active.cache_tokens(tokens), cache)

    def step(self, stats: WorkerStats) -> list[Ended]:
        """One generation step: a prefill chunk for the prompts in progress and a
        token for each decoding request, each handed to its request. A failed step
        ends every running request with the error and starts a fresh generator.

        Returns the requests the step ended, out of ``running`` already, for the
        worker to finish (the list is valid until the next step)."""
        self._ended.clear()
        gen = self._gen
        lengths = mlxlm.prefill_lengths(gen)
        starting = lengths.count(0)  # nothing left to prefill: they decode from this step on
        decoding = starting + sum(a.state is RequestState.DECODE for a in self.running.values())
        waiting = len(lengths) - starting + len(self._staged)
        gen.prefill_step_size = chunk = scheduling.prefill_step(self.prefill_step_size, decoding, waiting)
        if self._staged:
            self._advance_staged(chunk)
            lengths = mlxlm.prefill_lengths(gen)  # a staged prompt may have joined the generator
        gen.prefill_batch_size = scheduling.prefill_width(lengths, chunk)
        try:
            prompt_responses, responses = gen.next()
        except Exception as e:  # a failed step must not kill the worker
            log.exception("generation step failed on %s", self.loaded.id)
            error = EngineError(f"Generation failed: {e}.")
            for failed in list(self.running.values()):
                self._end(failed, FinishReason.ERROR, error)
            self.reset()
            return self._ended
        started: list[ActiveRequest] = []
        for pr in prompt_responses:
            if (active := self.running.get(pr.uid)) is not None:
                active.state = RequestState.DECODE if pr.end_of_prompt else RequestState.PREFILL
                if pr.end_of_prompt:
                    started.append(active)
        stats.note_step(len(responses))
        for r in responses:
            self._on_token(r)
        if started:
            self._hand_out_first_tokens(started)
        self._drop_failed()
        if self.step_times is not None and (not responses or not self.running):
            # nothing decoding now or after this step (the worker may idle, a load run):
            # the gap until the next decode step is no step's, nor a collection in it
            self.step_times.pause()
        return self._ended

    def _end(self, active: ActiveRequest, reason: FinishReason, error: GmlxError | None) -> None:
        self.running.pop(active.uid, None)  # type: ignore[arg-type]
        self._ended.append((active, reason, error))

    def _on_token(self, r: Any) -> None:
        """Run a token the generator returned (its response) down its request's
        pipeline; end the request when the token ended it."""
        active = self.running.get(r.uid)
        if active is None:
            return
        try:
            finish = active.take(r.token, r.logprobs, r.finish_reason)
        except Exception as e:  # noqa: BLE001 - its own text pipeline failed
            if r.finish_reason is None:  # mlx-lm ends it otherwise, and keeps no state of it
                self.remove(active, keep_kv=False)
            self._fail(active, e)
            return
        if r.finish_reason is not None and r.prompt_cache is not None:
            self.prompt_cache.insert(active.cache_tokens(r.all_tokens), r.prompt_cache)
        if finish is not None:
            if r.finish_reason is None:  # a stop string ended it: mlx-lm would go on
                self.remove(active)
            self._end(active, finish, None)

    def _hand_out_first_tokens(self, started: list[ActiveRequest]) -> None:
        """Hand out the first token of requests whose prompt just finished, now.

        mlx-lm computes a request's first token in the step that ends its prompt but
        returns it only from the next step, after building that step's graph: the
        first token waits for one more graph (on a CPU, where building overlaps
        nothing, the whole next step: a 2k-token prefix hit's first token came after
        18.4 ms, now 16.7; on an H200 timeline that graph took ~10 ms of a 46 ms hit).
        On an accelerator, reading it here costs the running streams that one overlap,
        once per admission. Left to mlx-lm: a token that ends the request (an
        end-of-sequence token, or the only one asked for), so its ending stays mlx-lm's."""
        eos = self.loaded.tokenizer.eos_token_ids
        for active in started:
            if active.request.max_tokens <= 1:
                continue
            try:
                first = mlxlm.first_token(self._gen, active.uid)  # type: ignore[arg-type]
            except Exception:  # mlx-lm's own step will hand it out (or fail it)
                log.exception("reading the first token of %s early failed", active.request.id)
                continue
            if first is None or first.token in eos:
                continue
            self._on_token(first)
            active.handed_out = first.token

    def _drop_failed(self) -> None:
        """End the requests whose own sampler or processor failed in this step."""
        for active in [a for a in self.running.values() if a.failure is not None]:
            self.remove(active, keep_kv=False)
            self._fail(active, active.failure)

    def _fail(self, active: ActiveRequest, failure: BaseException | None) -> None:
        """End ``active`` alone with an ``engine_error`` naming it (it is out of the
        generator already); the rest of the batch goes on."""
        rid = active.request.id
        log.error("request %s failed: %r", rid, failure, exc_info=failure)
        self._end(active, FinishReason.ERROR, EngineError(f"Request {rid} failed: {failure}."))

    def reset(self) -> None:
        """Drop every running request and start a fresh generator (after a failure: the
        generator's state cannot be trusted). The caller has ended the requests."""
        self.running.clear()
        self._staged.clear()
        gen, self._gen = self._gen, None
        if gen is not None:
            try:
                gen.close()
            except Exception:  # it is being replaced
                log.exception("closing the failed generator of %s", self.loaded.id)
        self.open()
