"""Samplers and logits processors for one request, built on mlx-lm's.

mlx-lm's ``make_sampler`` draws from MLX's global random state, which every
request in a batch shares; a request's ``seed`` must make its output repeatable
whatever else is running, so the final draw here uses a key owned by the request.
The filters themselves (top-k, top-p, min-p) are mlx-lm's.
"""

from __future__ import annotations

import random
from collections.abc import Callable

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


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError for values no sampler can honour."""
    checks = [
        (params.temperature >= 0, "temperature", "must be >= 0"),
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
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        if getattr(params, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1.", param=name)
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


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler over log-probabilities of shape (1, vocab) for one request.

    Greedy requests share mlx-lm's ``greedy_sampler`` object, so a batch of them
    is sampled in one call.
    """
    if params.greedy:
        return greedy_sampler
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < params.top_p < 1:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    key = mx.random.key(seed)
    inv_temp = 1.0 / params.temperature

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        for f in filters:
            logprobs = f(logprobs)
        key, draw = mx.random.split(key)
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sampler


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Penalties and logit bias, as mlx-lm's processors (empty list when unused)."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.frequency_context_size,
    )
