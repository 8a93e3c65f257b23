"""Speculative decoding inside continuous batching: draft, verify in one batched
forward, keep what the target model would have produced.

A speculative model's generator decodes with :class:`SpeculativeBatch` in place of
mlx-lm's ``GenerationBatch`` (the same duck type: ``uids``, ``next``, ``extend``,
``filter``, ``extract_cache``, ``tokens``, ``prompt_cache``), so admission, prefill,
the prompt cache and removal stay mlx-lm's and ``gmlx.engine.batch``'s.

How a batch is verified, each round (one ``next()``):

1. Every stream has a *pending* token (sampled last round, not yet in the KV) and
   proposes up to ``draft_tokens`` drafts after it (``gmlx.engine.drafters``). A
   stream drafts nothing when it has request-level logits processors (penalties, a
   thinking budget, a forced tool call's grammar), a sampler other than temperature,
   top-k, top-p and min-p, or too few ``max_tokens`` left. The round drafts ``K``
   positions, the most any stream proposed; shorter proposals are padded and their
   padding is never accepted.
2. The target scores every stream's ``[pending, d1..dK]`` in one forward of shape
   ``(width, K + 1)``.
3. Each stream accepts a prefix of its own drafts. Greedy: the longest prefix equal to
   the target's argmax at each position, then the argmax after it (the output is the
   target's own greedy output, token for token). Sampled: draft ``d`` at position ``j``
   is kept with probability ``p_j(d)`` (the drafts are deterministic, so the standard
   rule ``min(1, p/q)`` with ``q = 1``); the first rejected position draws from ``p_j``
   with ``d`` removed and renormalised, and a fully accepted row draws a bonus token
   from ``p_K``: every emitted token follows the target's filtered, tempered
   distribution. A stream without drafts samples position 0 with its own sampler and
   processors, exactly as mlx-lm's step does.
4. Each stream emits its pending token and its accepted drafts; the token drawn after
   them is its new pending token. Its KV keeps exactly the emitted positions: the
   batched cache (left-padded, all rows ending at one index) is trimmed to the longest
   row and every shorter row is rolled right by its shortfall, the rolled-out
   positions becoming left padding (``spec_cache.trim_rows``). Per-stream trimming is exact;
   what it costs is a copy of the KV of a round whose rows accepted different counts.

A stream that ends inside a round (an end-of-sequence token, ``max_tokens``) leaves
with a cache cut to the tokens it emitted. Greedy output equals the undrafted output
up to floating-point ties: the target scores ``K + 1`` positions at once, whose sums
may round differently from one position at a time. Log-probabilities are computed as
mlx-lm's step computes them (in the model's dtype, after the stream's processors).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import TokenBuffer

from gmlx.engine import mlxlm, sampling, spec_cache
from gmlx.engine.drafting import DraftSpec, SpecStats
from gmlx.engine.errors import ModelSourceError
from gmlx.engine.types import SamplingParams

Response = GenerationBatch.Response
log = logging.getLogger("gmlx.engine")


@dataclass
class StreamPolicy:
    """How one stream takes part in rounds: its sampling (None: greedy), whether it
    may draft at all, and where its counts go."""

    draftable: bool
    distribution: Callable[[mx.array], mx.array] | None = None  # logprobs -> filtered logits
    key: Any = None  # the stream's own random key (sampled streams)
    stats: SpecStats = field(default_factory=SpecStats)


PLAIN = StreamPolicy(draftable=False)


def policy_for(params: SamplingParams, has_processors: bool, stats: SpecStats) -> StreamPolicy:
    """The policy of a request with ``params``: greedy and temperature/top-k/top-p/
    min-p sampling draft; other samplers and logits processors do not."""
    if has_processors:
        return StreamPolicy(False, stats=stats)
    if params.greedy:
        return StreamPolicy(True, stats=stats)
    if (params.top_n_sigma > 0 or params.typical_p < 1 or params.p_less
            or params.xtc_probability > 0):
        return StreamPolicy(False, stats=stats)
    inv_temp = 1.0 / params.temperature
    filters = sampling.logit_filters(params)

    def distribution(logprobs: mx.array) -> mx.array:  # the sampler's own filters, in order
        for f in filters:
            logprobs = f(logprobs)
        return logprobs * inv_temp

    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return StreamPolicy(True, distribution, mx.random.key((seed + 1) % 2**64), stats)


class SpeculativeBatch:
    """The decoding streams of a speculative model (see the module's docstring).

    Args:
        model: the target model.
        drafter: proposes drafts (``gmlx.engine.drafters``).
        draft_tokens: most drafts per stream per round.
        policy_of: the policy of a stream by its generator uid, read when it joins.
    """

    def __init__(self, model: Any, drafter: Any, draft_tokens: int,
                 policy_of: Callable[[int, bool], StreamPolicy]) -> None:
        self.model = model
        self.drafter = drafter
        self.k = draft_tokens
        self.policy_of = policy_of
        self.uids: list[int] = []
        self.prompt_cache: list[Any] = []
        self.tokens: list[list[int]] = []
        self.samplers: list[Any] = []
        self.logits_processors: list[Any] = []
        self.max_tokens: list[int] = []
        self.stop_sequences: list[Any] = []
        self.policies: list[StreamPolicy] = []
        self._matchers: list[Any] = []
        self._num_tokens: list[int] = []
        self._contexts: list[Any] = []
        # read by ``mlxlm.first_token``, as on mlx-lm's batch
        self._next_tokens: mx.array | None = None
        self._next_logprobs: list[mx.array] = []

    def __len__(self) -> int:
        return len(self.uids)

    # -- membership -----------------------------------------------------------------

    def extend(self, batch: Any) -> None:
        """Take in the streams of mlx-lm's fresh generation batch ``batch`` (their
        prompts in its KV, their first token sampled and pending)."""
        if not batch.uids:
            return
        pending, logprobs = mlxlm.pending_tokens(batch)
        self.prompt_cache = spec_cache.extend(self.prompt_cache, batch.prompt_cache)
        for i, uid in enumerate(batch.uids):
            processors = batch.logits_processors[i] if batch.logits_processors else ()
            self.uids.append(uid)
            self.tokens.append(batch.tokens[i])
            self.samplers.append(batch.samplers[i] if batch.samplers else batch.fallback_sampler)
            self.logits_processors.append(processors)
            self.max_tokens.append(batch.max_tokens[i])
            self.stop_sequences.append(batch.stop_sequences[i])
            self._matchers.append(batch.stop_sequences[i].matcher())
            self._num_tokens.append(0)
            self._contexts.append(TokenBuffer(batch.tokens[i]) if processors else None)
            self.policies.append(self.policy_of(uid, bool(processors)))
        self._next_tokens = (pending if self._next_tokens is None or self._next_tokens.size == 0
                             else mx.concatenate([self._next_tokens, pending]))
        self._next_logprobs.extend(logprobs)
        self.drafter.admit([list(t) for t in batch.tokens])

    def filter(self, keep: list[int]) -> None:
        """Keep only the streams at ``keep`` (indices, in order)."""
        for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                     "stop_sequences", "policies", "_matchers", "_num_tokens", "_contexts",
                     "_next_logprobs"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        if keep:
            for c in self.prompt_cache:
                c.filter(keep)
            self._next_tokens = self._next_tokens[mx.array(keep)]  # type: ignore[index]
        else:
            self.prompt_cache = []
            self._next_tokens = None
        self.drafter.filter(keep)

    def extract_cache(self, idx: int) -> list[Any]:
        return [c.extract(idx) for c in self.prompt_cache]

    # -- a round --------------------------------------------------------------------

    def next(self) -> list[Any]:
        """One round: draft, verify, emit; returns each stream's emitted tokens as
        mlx-lm's responses, in order (several per stream)."""
        if not self.uids:
            return []
        width = len(self.uids)
        pending = self._next_tokens.tolist()  # type: ignore[union-attr]
        last = [t[-1] for t in self.tokens]
        caps = [min(self.k, self.max_tokens[i] - self._num_tokens[i] - 1)
                if self.policies[i].draftable else 0 for i in range(width)]
        drafts, real = self.drafter.propose(self.tokens, last, pending, caps, self.k)
        n_draft = drafts.shape[1]
        inputs = mx.concatenate([self._next_tokens[:, None].astype(mx.uint32),  # type: ignore[index]
                                 drafts.astype(mx.uint32)], axis=1)
        logits = self.model(inputs, cache=self.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1)
        picks: list[Any] = []  # per stream: what decides its acceptance and next token
        for i in range(width):
            policy = self.policies[i]
            if real[i] == 0:
                picks.append(self._plain_pick(i, logits[i, :1], pending[i]))
            elif policy.distribution is None:
                picks.append(("greedy", greedy[i]))
            else:
                picks.append(self._sampled_pick(policy, logprobs[i, : real[i] + 1], drafts[i, : real[i]]))
        mx.eval(drafts, greedy, logprobs, [p[1:] for p in picks], [c.state for c in self.prompt_cache],
                self.drafter.state())
        drafted = drafts.tolist()
        accepted: list[int] = []
        nexts: list[int] = []
        next_logprobs: list[mx.array] = []
        for i in range(width):
            n, token, lp = self._decide(picks[i], drafted[i], real[i], logprobs[i])
            accepted.append(n)
            nexts.append(token)
            next_logprobs.append(lp)
            if real[i]:
                self.policies[i].stats.note(real[i], n)
        keep_kv = [n + 1 for n in accepted]
        spec_cache.trim_rows(self.prompt_cache, n_draft + 1, keep_kv)
        self.drafter.commit(n_draft, accepted)
        return self._emit(pending, drafted, accepted, nexts, next_logprobs, logprobs)

    def _plain_pick(self, i: int, logits: mx.array, pending: int) -> tuple[Any, ...]:
        """Position 0 through the stream's own processors and sampler (mlx-lm's step)."""
        if self.logits_processors[i]:
            context = self._contexts[i].update_and_fetch(mx.array([pending]))
            for processor in self.logits_processors[i]:
                logits = processor(context, logits)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return ("plain", self.samplers[i](lp), lp[0])

    @staticmethod
    def _sampled_pick(policy: StreamPolicy, logprobs: mx.array, drafts: mx.array) -> tuple[Any, ...]:
        """The standard acceptance rule's draws for one stream: the chance to keep each
        draft, a uniform per draft, and a token per position drawn from the target's
        distribution with that position's draft removed (the last: the bonus)."""
        policy.key, draw, coin = mx.random.split(policy.key, 3)
        scores = policy.distribution(logprobs)  # type: ignore[misc]
        r = drafts.shape[0]
        chance = mx.softmax(scores[:r], axis=-1)[mx.arange(r), drafts]
        uniform = mx.random.uniform(shape=(r,), key=coin)
        vocab = mx.arange(scores.shape[-1])
        removed = mx.concatenate([drafts.astype(mx.int32), mx.array([-1], dtype=mx.int32)])
        residual = mx.where(vocab[None, :] == removed[:, None], -mx.inf, scores)
        return ("sampled", chance, uniform, mx.random.categorical(residual, key=draw))

    def _decide(self, pick: tuple[Any, ...], drafts: list[int], real: int,
                logprobs: mx.array) -> tuple[int, int, mx.array]:
        """How many drafts a stream keeps, its next pending token and that token's
        log-probabilities."""
        kind = pick[0]
        if kind == "plain":
            return 0, int(pick[1].item()), pick[2]
        if kind == "greedy":
            target = pick[1].tolist()
            n = 0
            while n < real and drafts[n] == target[n]:
                n += 1
            return n, target[n], logprobs[n]
        chance, uniform, tokens = (p.tolist() for p in pick[1:])
        n = 0
        while n < real and uniform[n] < chance[n]:
            n += 1
        return n, tokens[n], logprobs[n]

    def _emit(self, pending: list[int], drafted: list[list[int]], accepted: list[int],
              nexts: list[int], next_logprobs: list[mx.array], logprobs: mx.array) -> list[Any]:
        responses = []
        keep = []
        for i, uid in enumerate(self.uids):
            n = accepted[i]
            emitted = [pending[i], *drafted[i][:n]]
            lps = [self._next_logprobs[i], *(logprobs[i, j] for j in range(n))]
            self.tokens[i].extend(emitted)
            finish = None
            for j, token in enumerate(emitted):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(token):
                    finish = "stop"
                if finish is None:
                    responses.append(Response(uid, token, lps[j], None, None, None))
                    continue
                cut = n - j  # accepted positions past the end: out of its cache
                all_tokens = self.tokens[i][: len(self.tokens[i]) - cut]
                responses.append(Response(uid, token, lps[j], finish,
                                          spec_cache.cut(self.extract_cache(i), cut), all_tokens))
                break
            if finish is None:
                keep.append(i)
                if self._contexts[i] is not None and n:  # keep a processor's context whole
                    self._contexts[i].update_and_fetch(mx.array(emitted[1:]))
        self._next_tokens = mx.array(nexts, dtype=mx.uint32)
        self._next_logprobs = next_logprobs
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


@dataclass
class Speculation:
    """A worker's drafting: its spec and, for a draft model, that model's
    ``LoadedModel`` (loaded once, shared by every generator the worker opens; the
    capacity model prices it beside the target)."""

    spec: DraftSpec
    draft: Any = None
    vocab_limit: int | None = None  # the target's vocabulary: drafts never exceed it

    @property
    def draft_model(self) -> Any:
        return None if self.draft is None else self.draft.model

    def generation_batch(self, model: Any, policy_of: Callable[[int, bool], StreamPolicy],
                         prefill_step: int) -> SpeculativeBatch:
        from gmlx.engine.drafters import ModelDrafter, PromptLookup

        drafter = (PromptLookup() if self.spec.prompt_lookup
                   else ModelDrafter(self.draft_model, prefill_step, self.vocab_limit))
        return SpeculativeBatch(model, drafter, self.spec.draft_tokens, policy_of)


def load_speculation(spec: DraftSpec, target: Any) -> Any:
    """The drafting of a model loaded as ``target`` (a ``LoadedModel``): a
    :class:`~gmlx.engine.speculative.Speculation`. Loads the draft model and checks it
    against the target: the same vocabulary, token for token. Raises ModelSourceError
    (a draft model that does not load, another vocabulary, a cache that cannot be
    trimmed per stream)."""
    if (why := spec_cache.check_cache(target.model)) is not None:
        raise ModelSourceError(f"{target.id} cannot decode speculatively: {why}.")
    if spec.prompt_lookup:
        return Speculation(spec)
    from gmlx.engine.loading import load_model

    draft = load_model(str(spec.draft_source))
    mine, theirs = target.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise ModelSourceError(
            f"The draft model {spec.draft_source} does not share {target.id}'s tokenizer: "
            f"their vocabularies ({len(theirs)} and {len(mine)} tokens) differ in {differ} entries."
        )
    if (why := spec_cache.check_cache(draft.model)) is not None:
        raise ModelSourceError(f"The draft model {spec.draft_source} cannot draft: {why}.")
    from gmlx.engine.kernels import prepare_layers

    for note in prepare_layers(draft.model):  # as the target's layers
        log.info("%s's draft model: %s", target.id, note)
    log.info("%s drafts with %s (%d tokens a round)", target.id, spec.draft_source, spec.draft_tokens)
    return Speculation(spec, draft, int(target.config.get("vocab_size") or len(target.tokenizer)))
