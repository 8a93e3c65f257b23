"""Samplers and logits processors for one request, built on mlx-lm's.

mlx-lm's ``make_sampler`` draws from MLX's global random state, which every
request in a batch shares; a request's ``seed`` must make its output repeatable
whatever else is running, so every random draw here (XTC's coin, the final
sample) uses a key owned by the request. top-k, top-p and min-p are mlx-lm's
filters; top-n-sigma, typical-p, P-less and a keyed XTC are written here.

Filters run in this order: top-n-sigma, top-k, typical-p, top-p, min-p, P-less,
XTC, then temperature and the draw.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


INT32_MAX = 2**31 - 1


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError for values no sampler can honour."""
    checks = [
        (params.temperature >= 0, "temperature", "must be >= 0"),
        (params.top_n_sigma >= 0, "top_n_sigma", "must be >= 0"),
        (0 < params.typical_p <= 1, "typical_p", "must be in (0, 1]"),
        (0 <= params.xtc_probability <= 1, "xtc_probability", "must be in [0, 1]"),
        (0 <= params.xtc_threshold <= 1, "xtc_threshold", "must be in [0, 1]"),
        (0 < params.top_p <= 1, "top_p", "must be in (0, 1]"),
        (params.top_k >= 0, "top_k", "must be >= 0"),
        (0 <= params.min_p <= 1, "min_p", "must be in [0, 1]"),
        (params.repetition_penalty is None or params.repetition_penalty > 0,
         "repetition_penalty", "must be > 0"),
        (-2 <= params.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
        (-2 <= params.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
    ]
    for ok, name, rule in checks:
        if not ok:
            raise InvalidRequestError(f"{name} {rule}.", param=name)
    # MLX takes these as 32-bit ints: a larger one would fail the step mid-batch.
    for name in ("top_k", "repetition_context_size", "presence_context_size",
                 "frequency_context_size"):
        if getattr(params, name) > INT32_MAX:
            raise InvalidRequestError(f"{name} must be <= {INT32_MAX}.", param=name)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        if getattr(params, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1.", param=name)
    if params.seed is not None and not -(2**63) <= params.seed < 2**64:
        raise InvalidRequestError("seed must fit in 64 bits.", param="seed")
    for token, bias in (params.logit_bias or {}).items():
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1}).",
                param="logit_bias",
            )
        if not -100 <= bias <= 100:
            raise InvalidRequestError(
                f"logit_bias value {bias} for token {token} must be in [-100, 100].",
                param="logit_bias",
            )


NEG_INF = float("-inf")


def apply_top_n_sigma(logprobs: mx.array, n: float) -> mx.array:
    """Keep tokens whose logit is within ``n`` standard deviations of the largest."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    sigma = mx.std(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs >= top - n * sigma, logprobs, NEG_INF)


def apply_typical_p(logprobs: mx.array, mass: float) -> mx.array:
    """Locally typical sampling: keep the tokens whose surprise is closest to the
    distribution's entropy, up to ``mass`` of probability."""
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    probs = mx.exp(logprobs)
    finite = mx.isfinite(logprobs)
    entropy = -mx.sum(mx.where(finite, probs * logprobs, 0.0), axis=-1, keepdims=True)
    distance = mx.where(finite, mx.abs(-logprobs - entropy), float("inf"))
    order = mx.argsort(distance, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < mass  # at least one
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, NEG_INF)


def apply_p_less(logprobs: mx.array) -> mx.array:
    """P-less truncation: keep tokens at least as likely as two draws colliding
    (sum of p squared); it needs no hyperparameter and never empties the set."""
    probs = mx.exp(logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True))
    collision = mx.sum(probs * probs, axis=-1, keepdims=True)
    return mx.where(probs >= collision, logprobs, NEG_INF)


def apply_xtc(
    logprobs: mx.array, coin: mx.array, probability: float, threshold: float, keep_ids: mx.array | None
) -> mx.array:
    """Exclude Top Choices: when ``coin < probability`` and two or more tokens reach
    ``threshold``, drop all of them but the least likely (``keep_ids``, such as EOS
    and newline, are never dropped)."""
    probs = mx.exp(logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True))
    above = probs >= threshold
    least = mx.min(mx.where(above, probs, float("inf")), axis=-1, keepdims=True)
    drop = above & (probs > least)
    if keep_ids is not None and keep_ids.size:
        drop = drop & ~mx.any(mx.arange(probs.shape[-1])[None, :, None] == keep_ids[None, None, :], axis=-1)
    active = (coin < probability) & (mx.sum(above, axis=-1, keepdims=True) >= 2)
    return mx.where(active & drop, NEG_INF, logprobs)


def logit_filters(params: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    """The filters a sampled request's log-probabilities go through, in order, before
    XTC, the temperature and the draw (the deterministic part of its sampler)."""
    filters: list[Callable[[mx.array], mx.array]] = []
    if params.top_n_sigma > 0:
        filters.append(lambda x: apply_top_n_sigma(x, params.top_n_sigma))
    if params.top_k > 0:
        # mlx-lm refuses k >= vocab; keeping that many tokens is keeping them all.
        filters.append(lambda x: apply_top_k(x, params.top_k) if params.top_k < x.shape[-1] else x)
    if params.typical_p < 1:
        filters.append(lambda x: apply_typical_p(x, params.typical_p))
    if 0 < params.top_p < 1:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.p_less:
        filters.append(apply_p_less)
    return filters


def greedy_logprobs_sampler(logprobs: mx.array) -> mx.array:
    """mlx-lm's ``greedy_sampler`` (the same argmax) for greedy requests that asked for
    log-probabilities. A distinct object, so a decode step can tell it must normalize
    its logits for them; a batch of either sampler is still sampled in one call."""
    return greedy_sampler(logprobs)


def make_sampler(params: SamplingParams, protected_ids: list[int] | None = None) -> Sampler:
    """A sampler over log-probabilities of shape (1, vocab) for one request.

    Greedy requests share mlx-lm's ``greedy_sampler`` object, so a batch of them
    is sampled in one call. ``protected_ids`` (EOS, newline) are never excluded by XTC.
    """
    if params.greedy:
        return greedy_sampler
    filters = logit_filters(params)
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    key = mx.random.key(seed % 2**64)  # MLX keys are unsigned; OpenAI seeds may be negative
    inv_temp = 1.0 / params.temperature
    xtc = params.xtc_probability > 0
    keep_ids = mx.array(protected_ids or [], dtype=mx.int32)

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw, coin_key = mx.random.split(key, 3)
        for f in filters:
            logprobs = f(logprobs)
        if xtc:
            coin = mx.random.uniform(shape=(logprobs.shape[0], 1), key=coin_key)
            logprobs = apply_xtc(logprobs, coin, params.xtc_probability, params.xtc_threshold, keep_ids)
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sampler


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Logit bias (first: a :class:`LogitBias`, which a decode step adds for all its rows
    at once) and penalties, as mlx-lm's processors; an empty list when unused."""
    bias: list[LogitsProcessor] = [LogitBias(params.logit_bias)] if params.logit_bias else []
    return bias + make_logits_processors(
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.frequency_context_size,
    )


class LogitBias:
    """A request's logit bias as a logits processor (mlx-lm's ``(tokens, logits)``:
    ``bias[id]`` added to the logit of each token ``id``). It reads no tokens and cannot
    fail on a validated request, so a decode step may add every row's bias in one
    scatter (:class:`BatchBias`) in place of calling it row by row."""

    __slots__ = ("_ids", "_values", "ids", "values")

    def __init__(self, bias: Mapping[int, float]) -> None:
        self.ids = [int(t) for t in bias]
        self.values = [float(v) for v in bias.values()]
        self._ids = mx.array(self.ids, dtype=mx.int32)
        self._values = mx.array(self.values, dtype=mx.float32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, self._ids].add(self._values)


class BatchBias:
    """The logit biases of a batch's rows added in one scatter: ``apply(logits, biases)``
    with ``biases[e]`` row ``e``'s :class:`LogitBias` (or None) equals calling each on
    its row. The scatter's indices are built once per sequence of biases, and again only
    when the rows change (a stream joins or leaves)."""

    __slots__ = ("_ids", "_key", "_rows", "_values")

    def __init__(self) -> None:
        self._key: tuple[LogitBias | None, ...] = ()
        self._rows = self._ids = self._values = mx.array([])

    def apply(self, logits: mx.array, biases: list[LogitBias | None]) -> mx.array:
        key = tuple(biases)  # held, so no id is reused while it is the key
        if key != self._key:
            # joined from each bias's own arrays: a client's bias may hold thousands of
            # ids (every special and partial token), and the rows change at every step a
            # stream joins or leaves (lists of 32 such biases took ~6.5 ms a rebuild)
            present = [(row, b) for row, b in enumerate(biases) if b is not None]
            if present:
                self._rows = mx.concatenate([mx.full((len(b.ids),), row, dtype=mx.int32) for row, b in present])
                self._ids = mx.concatenate([b._ids for _, b in present])
                self._values = mx.concatenate([b._values for _, b in present])
            else:
                self._rows = self._ids = self._values = mx.array([])
            self._key = key
        if not self._ids.size:
            return logits
        return logits.at[self._rows, self._ids].add(self._values)
