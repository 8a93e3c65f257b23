"""Everything gmlx reads or writes of mlx-lm that mlx-lm does not publish.

mlx-lm's private names (a leading underscore) may change in any release. Each one
gmlx touches is behind a small function here, so moving to a new mlx-lm is this
file's work: check each function against the new release (the tests drive every
one). Nothing else in gmlx may name an mlx-lm private attribute.

mlx-lm is imported inside the functions: importing this module stays cheap (the
CLI's ``--help`` never loads MLX).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FirstToken",
    "batch_generator",
    "first_token",
    "greedy_argmax",
    "infer_tool_parser",
    "kv_used",
    "model_classes",
    "pending_tokens",
    "prefill_lengths",
    "route_attention",
    "route_clear_cache",
    "route_greedy",
    "set_kv_used",
    "use_generation_batch",
]


# -- models and tokenizers ------------------------------------------------------------


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """The model class and its ``ModelArgs`` class for a model's ``config.json``
    (``mlx_lm.utils._get_classes``). Raises ValueError when mlx-lm has no model
    module for its type."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def infer_tool_parser(hf_tokenizer: Any) -> str | None:
    """The name of the ``mlx_lm.tool_parsers`` module that fits a Hugging Face
    tokenizer's chat template, or None (``mlx_lm.tokenizer_utils._infer_tool_parser``)."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    return _infer_tool_parser(hf_tokenizer)


# -- the batch generator --------------------------------------------------------------


def batch_generator(model: Any, stop_tokens: list[int], width: int, prefill_step: int,
                    stream: Any = None, times: Any = None) -> Any:
    """mlx-lm's ``BatchGenerator`` decoding up to ``width`` streams, each ending at any
    of ``stop_tokens``. Prompts prefill ``prefill_step`` tokens a step, one prompt at
    a time until the caller sets ``prefill_batch_size`` (the worker sets both before
    every step). ``stream``: the one it computes on (default: mlx-lm's own). ``times``:
    a :class:`~gmlx.engine.step_times.StepTimes` its decode steps are stamped into."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in stop_tokens],
        completion_batch_size=width,
        prefill_batch_size=1,
        prefill_step_size=prefill_step,
        **({} if stream is None else {"stream": stream}),
    )
    gen._generation_batch = _decode_batch().empty(model, gen.sampler)
    gen._generation_batch.times = times
    return gen


@functools.cache
def _decode_batch() -> type:
    """mlx-lm's ``GenerationBatch`` with its decode step's per-row work batched: the
    streams' logit biases (:class:`~gmlx.engine.sampling.LogitBias`, first in a stream's
    processors) are added to all rows in one scatter, and the step's log-probabilities
    are evaluated whole, where mlx-lm calls each stream's processors on its own row and
    evaluates every row's log-probabilities as an array of its own. At 32 streams with a
    bias each that is ~5 graph operations a stream fewer a step. Other processors
    (penalties, a grammar) still run row by row, after the bias, as mlx-lm runs them.
    A step whose rows all sample greedily, none asking for log-probabilities, takes the
    argmax of the logits and computes no log-probabilities (its rows' are None): two
    graph operations over the vocabulary and a view a row fewer (``_needs_logprobs``);
    that argmax is ``mx.argmax`` unless a load routed it elsewhere (:func:`route_greedy`:
    on CUDA, gmlx's kernel).
    A prompt's first token is still sampled by mlx-lm's own step, as it joins."""
    import time

    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch

    from gmlx.engine.sampling import BatchBias, LogitBias, greedy_logprobs_sampler, greedy_sampler

    class DecodeBatch(GenerationBatch):
        times = None  # a StepTimes, where the step's phases are wanted (GMLX_STEP_TIMES)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._bias = BatchBias()
            super().__init__(*args, **kwargs)

        def _step(self) -> tuple[list[int], list[Any]]:
            # mlx-lm 0.32's GenerationBatch._step but for the processors and the
            # log-probabilities' evaluation (and the phases' stamps, where wanted)
            begin = time.perf_counter()
            self._current_tokens = self._next_tokens
            self._current_logprobs = self._next_logprobs
            inputs = self._current_tokens
            logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
            logits, token_context = self._processed(logits, inputs)
            samplers = self._samplers()
            normalize = self._needs_logprobs(samplers)
            # the two greedy samplers are one kind: one batched argmax
            samplers = [greedy_sampler if s is greedy_logprobs_sampler else s for s in samplers]
            if normalize:
                scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                self._next_logprobs = list(scores)  # views of `scores`, evaluated with it
                wanted = [scores]
            else:
                scores = logits
                self._next_logprobs = [None] * len(samplers)
                wanted = []
            if samplers and all(s is greedy_sampler for s in samplers):
                sampled = greedy_argmax(scores)  # mx.argmax, or a kernel's (route_greedy)
            elif not samplers or all(s is samplers[0] for s in samplers):
                sampled = (samplers[0] if samplers else self.fallback_sampler)(scores)
            else:
                sampled = mx.concatenate([s(scores[e:e + 1]) for e, s in enumerate(samplers)], axis=0)
            self._next_tokens = sampled
            built = time.perf_counter()
            mx.async_eval(sampled, *wanted, token_context)
            handed = time.perf_counter()
            mx.eval(inputs)
            waited = time.perf_counter()
            tokens = inputs.tolist()
            if self.times is not None:
                self.times.note(len(tokens), begin, built, handed, waited, time.perf_counter())
            for held, token in zip(self.tokens, tokens, strict=True):
                held.append(token)
            return tokens, self._current_logprobs

        def _samplers(self) -> list[Any]:
            """Each row's sampler (mlx-lm's fallback where a row has none)."""
            return [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * len(self.uids))]

        @staticmethod
        def _needs_logprobs(samplers: list[Any]) -> bool:
            """Whether the step must normalize its logits into log-probabilities
            (a logsumexp and a subtraction over the vocabulary, and a view a row).
            Not when every row samples with ``greedy_sampler``: an argmax is the same
            over logits, and a greedy request that asked for log-probabilities has
            ``greedy_logprobs_sampler`` instead. Every other sampler may read
            probabilities (a draw, a top-p or min-p filter), so it keeps them."""
            return any(s is not greedy_sampler for s in samplers)

        def _processed(self, logits: Any, inputs: Any) -> tuple[Any, list[Any]]:
            """``logits`` through each row's processors: the biases in one scatter,
            the rest row by row (each reading its row's tokens, kept here)."""
            rows = self.logits_processors
            if not any(rows):
                return logits, []
            biases = [p[0] if p and isinstance(p[0], LogitBias) else None for p in rows]
            if any(b is not None for b in biases):
                logits = self._bias.apply(logits, biases)
                rows = [p[1:] if b is not None else p for p, b in zip(rows, biases, strict=True)]
                if not any(rows):
                    return logits, []
            pieces, token_context = [], []
            for e, processors in enumerate(rows):
                row = logits[e:e + 1]
                if processors:
                    context = self._token_context[e].update_and_fetch(inputs[e:e + 1])
                    token_context.append(context)
                    for processor in processors:
                        row = processor(context, row)
                pieces.append(row)
            return mx.concatenate(pieces, axis=0), token_context

    return DecodeBatch


def prefill_lengths(gen: Any) -> list[int]:
    """The prompt tokens each prompt in ``gen`` has left to prefill in its current
    segment, in the order the generator prefills them: those prefilling, then those not
    started. 0 for a prompt left with its last token alone: the generator moves it to
    decoding before the step's prefill, which its first decode step takes (it still
    holds a place in the prompt batch until then).

    Reads ``BatchGenerator._currently_processing`` (entries ``[segments, done,
    total]``) and ``_unprocessed_sequences`` (tuples ``(uid, segments, ...)``)."""

    def left(segments: list[list[int]]) -> int:
        return 0 if len(segments) == 1 and len(segments[0]) == 1 else len(segments[0])

    lengths = [left(seq[0]) for seq in gen._currently_processing if seq[0]]
    lengths += [left(seq[1]) for seq in gen._unprocessed_sequences]
    return lengths


@dataclass
class FirstToken:
    """A first token read ahead of mlx-lm, shaped as its generation ``Response``."""

    uid: int
    token: int
    logprobs: Any
    finish_reason: None = None
    prompt_cache: None = None
    all_tokens: None = None


def first_token(gen: Any, uid: int) -> FirstToken | None:
    """The token ``gen`` will return for ``uid`` at its next step, read now: the step
    that ended ``uid``'s prompt computed it, and mlx-lm returns it only after building
    the next step's graph. None when ``uid`` is not decoding. Raises what MLX raises
    when that step failed (mlx-lm's own next step then reports it).

    Reads ``BatchGenerator._generation_batch`` and its ``uids``, ``_next_tokens``
    and ``_next_logprobs``; the read runs on the generator's stream, so it waits for
    no other stream."""
    import mlx.core as mx

    batch = gen._generation_batch
    if uid not in batch.uids:
        return None
    row = batch.uids.index(uid)
    with mx.stream(gen.stream):
        token = batch._next_tokens[row].item()
    return FirstToken(uid, token, batch._next_logprobs[row])


def use_generation_batch(gen: Any, batch: Any) -> None:
    """Make ``gen`` decode with ``batch`` (a speculative batch, shaped as mlx-lm's
    ``GenerationBatch``) in place of its own, before it decodes anything
    (``BatchGenerator._generation_batch``)."""
    if len(gen._generation_batch):
        raise RuntimeError("the generator is decoding already")
    gen._generation_batch = batch


def pending_tokens(batch: Any) -> tuple[Any, list[Any]]:
    """The tokens a fresh ``GenerationBatch`` sampled for its streams and has not
    returned yet, and their log-probabilities (``_next_tokens``, ``_next_logprobs``)."""
    return batch._next_tokens, list(batch._next_logprobs)


# -- KV caches --------------------------------------------------------------------------


def kv_used(cache: Any) -> int:
    """Positions in use in a ``BatchKVCache`` layer's arrays, which may be longer
    (``BatchKVCache._idx``)."""
    return cache._idx


def set_kv_used(cache: Any, used: int) -> None:
    """Say that the first ``used`` positions of a ``BatchKVCache`` layer's arrays hold
    keys and values (``BatchKVCache._idx``)."""
    cache._idx = used


# -- the generator's buffer-cache clears ------------------------------------------------


def route_clear_cache(clear_cache: Callable[[], None]) -> None:
    """Make mlx-lm's generator call ``clear_cache`` where it calls ``mx.clear_cache()``
    (after every prefill chunk): the ``mx`` that ``mlx_lm.generate`` imported is replaced
    by a view of ``mlx.core`` with that one function changed. Calling it again with the
    same function changes nothing."""
    import importlib

    import mlx.core as mx

    module = importlib.import_module("mlx_lm.generate")
    if getattr(module.mx, "clear_cache", None) is clear_cache:
        return
    module.mx = _view(mx, clear_cache=clear_cache)  # type: ignore[attr-defined]


def _view(module: Any, **changed: Any) -> Any:
    """A module object holding what ``module`` holds, with ``changed`` names replaced:
    what an mlx-lm module sees in place of ``mlx.core`` (or ``mlx.core.fast``)."""
    import types

    view = types.ModuleType(module.__name__, module.__doc__)
    view.__dict__.update(vars(module))
    view.__dict__.update(changed)
    return view


# -- a greedy step's argmax --------------------------------------------------------------

def _mlx_argmax(logits: Any) -> Any:
    import mlx.core as mx

    return mx.argmax(logits, axis=-1)


_greedy: list[Callable[[Any], Any]] = [_mlx_argmax]  # what an all-greedy decode step takes its tokens with


def greedy_argmax(logits: Any) -> Any:
    """An all-greedy decode step's tokens from its logits (``(rows, vocabulary)`` ->
    ``uint32`` ``(rows,)``): ``mx.argmax``, or what a load routed (:func:`route_greedy`)."""
    return _greedy[0](logits)


def route_greedy(argmax: Callable[[Any], Any]) -> None:
    """Make the decode steps whose rows all sample greedily (none asking for
    log-probabilities) take their tokens with ``argmax(logits)`` (``(rows, vocabulary)``
    -> ``uint32`` ``(rows,)``, ``mx.argmax``'s index) instead of ``mx.argmax``: what a
    load does on CUDA once gmlx's kernel agreed (:func:`gmlx.engine.kernels.prepare_layers`)."""
    _greedy[0] = argmax


# -- the models' attention ---------------------------------------------------------------


def route_attention(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make mlx-lm's attention (``mlx_lm.models.base.scaled_dot_product_attention``, which
    its models call unless their cache is quantized) reach MLX's through
    ``wrap(mx.fast.scaled_dot_product_attention)``: the ``mx`` that ``mlx_lm.models.base``
    imported is replaced by a view of ``mlx.core`` whose ``fast`` is a view of
    ``mlx.core.fast`` with that one function changed. Calling it again changes nothing
    (the wrapped function carries ``__wrapped__``)."""
    import importlib

    import mlx.core as mx

    module = importlib.import_module("mlx_lm.models.base")
    if hasattr(module.mx.fast.scaled_dot_product_attention, "__wrapped__"):
        return
    fast = _view(mx.fast, scaled_dot_product_attention=wrap(mx.fast.scaled_dot_product_attention))
    module.mx = _view(mx, fast=fast)  # type: ignore[attr-defined]
