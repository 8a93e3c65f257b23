"""A one-token decode step over a batch cache as one compiled call, for CUDA.

A one-stream step of an 8B on the H200 is bound by the host: with the blocks compiled
in pieces (:mod:`compiled_blocks`) and the step's keys written in place by the attention
(:func:`cached_attention_cuda.attend_cached`), Python still builds ~100 calls a step (two
compiled pieces, an attention and the cache's bookkeeping for each of 32 blocks) in
1.4-2.0 ms, and MLX takes ~600 operations from them in 2.8-4.1 ms more, while the GPU
needs ~3 ms for the step. Here the model's whole one-token step is traced once, through
the model's own code, the layers' caches standing in as arrays (:class:`_Layer`), and
replayed from C++ after: one call a step, whose graph MLX's compiler simplifies and
fuses as a whole. What stays in Python is the cache's bookkeeping, once a step: room for
the step (the arrays grow by whole steps, :meth:`prompt_cache._AlignedBatchKVCache.
_reserve`), the write position as an array, and one ``offset + 1`` every layer shares.

A trace holds for one width and one cache length, which grows by whole steps of 256
positions, so a step that grows it traces again. Each (width, length) has its own
compiled function, and only the ``KEPT`` used last are kept: a trace holds its whole
graph (~2.9 MB each on this CPU for a 32-layer model), and a long-running server would
otherwise keep one for every width and length it ever met (dropping the function frees
it; :func:`traces.retrace` drops them all: a load's tuners time steps through them after
each change).
A layer's keys and values are written where MLX does not see it (in place, by the
attention kernel), so the step returns only the logits; with ``copying`` (the form this
CPU tests: no CUDA kernel runs here) each layer's cache takes the step's keys and values
as MLX's ``slice_update`` and attends over its whole length under a mask of each
stream's positions, and the step returns the arrays, which the caches keep. That form
copies every layer's cache each step: never a default. A layer whose attention does not
write in place (a shape the kernel does not take, a window) makes the trace fail, as
does anything else a trace meets (a kernel MLX refused): the model then runs its own
code from that step on (logged); the caches are changed only after the traced call.

Only one-token steps (``(B, 1)`` token ids, no embeddings) over a list of gmlx's batch
caches (every layer's a plain KV cache at the same position) take it; prompt steps, other
caches and other arguments run the model as it was. On by default where the attention
writes in place (CUDA, unless ``GMLX_CACHE_ATTENTION=0``); ``GMLX_WHOLE_STEP=0`` turns it
off. Served on an H100 (8B Q4_K_M, two alternating pairs against the blocks compiled in
pieces with the same attention) it was 1.23x and 1.27x at one stream.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from functools import cache
from typing import Any

import mlx.core as mx

from gmlx.engine.kernels import cached_attention_cuda, swaps
from gmlx.engine.kernels.traces import WHOLE_MARKER as MARKER
from gmlx.engine.kernels.traces import WHOLE_TRACED as TRACED
from gmlx.engine.kernels.traces import whole as attached

log = logging.getLogger(__name__)

ENV = "GMLX_WHOLE_STEP"
KEPT = 32  # traces kept a model, the least recently used dropped past it


class NotWhole(Exception):
    """A layer of the traced step did not write its keys in place."""


def enabled() -> bool:
    """Unless ``GMLX_WHOLE_STEP=0``, where one-token attention writes the cache in place
    (:func:`cached_attention_cuda.cached_enabled`) and no forward is handed over in chunks
    (``GMLX_HANDOVER_LAYERS``: it evaluates each chunk's output as the step is built,
    which a traced step cannot)."""
    from gmlx.engine import handover

    return (os.environ.get(ENV, "1") != "0" and cached_attention_cuda.cached_enabled()
            and not handover.layers_per_chunk())


def attach(model: Any, copying: bool = False) -> bool:
    """Give ``model`` (an mlx-lm ``Model``: token ids and a cache in, logits out) the
    compiled one-token step; ``copying`` for the form that updates the caches through
    MLX (the tests on the CPU). Whether it changed."""
    if attached(model):
        return False
    model.__class__ = _whole(type(model))
    object.__setattr__(model, TRACED, None)
    object.__setattr__(model, "_whole_copying", copying)
    object.__setattr__(model, "_whole_off", False)
    object.__setattr__(model, "_whole_ran", False)  # set at its first step: a later fallback is no model's nature
    return True


def detach(model: Any) -> None:
    """Give ``model`` its own class back (and drop its traces)."""
    if vars(type(model)).get(MARKER):
        model.__class__ = type(model).__bases__[0]
        object.__setattr__(model, TRACED, None)


def _batch(caches: Any) -> bool:
    """Whether ``caches`` are gmlx's batch caches, one a layer, holding keys (all of one
    class: a class test a layer, where a step of 32 layers spent ~35 us of host time in
    an attribute lookup a layer)."""
    if not isinstance(caches, list) or not caches:
        return False
    kind = type(caches[0])
    return (getattr(kind, "write_and_attend", None) is not None
            and all(type(c) is kind and c.keys is not None for c in caches))


class _Layer:
    """A layer's batch cache inside the traced step: its arrays, the batch's positions
    (``offset``) and padding, and the step's write position, each an input of the trace.
    The attention writes the step's keys and values in place (``write_and_attend``)."""

    def __init__(self, keys: Any, values: Any, offset: Any, padding: Any, position: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding = keys, values, offset, padding
        self.position = position

    def write_and_attend(self, attend: Any) -> Any:
        return attend(self.keys, self.values, self.left_padding, self.position)

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        raise NotWhole("a layer's attention does not write its keys in place")

    def make_mask(self, N: int, return_array: bool = False, window_size: Any = None, **kwargs: Any) -> Any:
        if window_size is not None:
            raise NotWhole("a layer attends over a window")
        return None  # the attention skips each stream's padding itself


class _Copying(_Layer):
    """A layer's batch cache inside the traced step in the copying form: the step's keys
    and values go in through ``slice_update`` (new arrays, which the step returns), and
    the attention reads the whole length under a mask of each stream's live positions."""

    write_and_attend = None  # type: ignore[assignment]

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        self.keys = mx.slice_update(self.keys, keys, self.position, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.position, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Any = None, **kwargs: Any) -> Any:
        if window_size is not None:
            raise NotWhole("a layer attends over a window")
        j = mx.arange(self.keys.shape[2])
        live = (j[None] >= self.left_padding[:, None]) & (j[None] <= self.position)
        return live[:, None, None, :]


def _trace(model: Any, call: Any, copying: bool) -> Any:
    """``model``'s one-token step (``call``: its class's own ``__call__``) compiled:
    ``(tokens, offset, padding, position, keys, values) -> logits`` (and the layers'
    new keys and values with ``copying``)."""
    layer = _Copying if copying else _Layer

    def step(tokens: Any, offset: Any, padding: Any, position: Any, keys: list[Any], values: list[Any]) -> Any:
        layers = [layer(k, v, offset, padding, position) for k, v in zip(keys, values, strict=True)]
        logits = call(model, tokens, cache=layers)
        if copying:
            return logits, [c.keys for c in layers], [c.values for c in layers]
        return logits

    return mx.compile(step)


def _step(model: Any, call: Any, tokens: Any, caches: list[Any]) -> Any:
    """One step through the trace; the caches' bookkeeping (room, positions) here."""
    from gmlx.engine.mlxlm import kv_used, set_kv_used

    first = caches[0]
    used = kv_used(first)
    if used + 1 > first.keys.shape[2] or caches[-1].keys.shape[2] != first.keys.shape[2]:
        for c in caches:  # (a batch's layers grow together: the first one full, all are)
            c._reserve(1)
    kept = getattr(model, TRACED)
    if kept is None:
        kept = OrderedDict()
        object.__setattr__(model, TRACED, kept)
    key = (tokens.shape[0], first.keys.shape[2])
    traced = kept.get(key)
    if traced is None:
        traced = kept[key] = _trace(model, call, model._whole_copying)
        if len(kept) > KEPT:
            kept.popitem(last=False)
    else:
        kept.move_to_end(key)
    position = mx.array([used], dtype=mx.int32)
    out = traced(tokens, first.offset, first.left_padding, position,
                 [c.keys for c in caches], [c.values for c in caches])
    if model._whole_copying:
        out, keys, values = out
        for c, k, v in zip(caches, keys, values, strict=True):
            c.keys, c.values = k, v
    offset = first.offset + 1  # one for every layer: a batch's layers advance together
    for c in caches:
        c.offset = offset
        set_kv_used(c, used + 1)
    return out


@cache
def _whole(cls: type) -> type:
    """``cls`` whose one-token steps over gmlx's batch caches run as one compiled call."""

    def __call__(self: Any, inputs: Any, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (args or kwargs or self._whole_off or inputs.ndim != 2 or inputs.shape[1] != 1
                or not _batch(cache)):
            return cls.__call__(self, inputs, cache, *args, **kwargs)
        try:
            out = _step(self, cls.__call__, inputs, cache)
        except Exception as error:  # noqa: BLE001 - NotWhole, or what a trace met (a kernel MLX refused)
            object.__setattr__(self, "_whole_off", True)
            object.__setattr__(self, TRACED, None)
            # a model whose layers do not all take the in-place step is expected (info), at its
            # first step; a trace that failed otherwise, or after whole steps had run, is not
            # (warning: every step after is slower, and served it must show)
            ran = self._whole_ran
            level = logging.INFO if isinstance(error, NotWhole) and not ran else logging.WARNING
            log.log(level, "the one-token step runs uncompiled%s: %s", " after whole steps had run" if ran else "",
                    error)
            return cls.__call__(self, inputs, cache)
        if not self._whole_ran:
            object.__setattr__(self, "_whole_ran", True)
        return out

    return swaps.subclass(cls, MARKER, __call__)
