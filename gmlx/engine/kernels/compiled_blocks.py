"""A one-token step's block in two compiled pieces, for mlx-lm's llama-pattern models.

A decode step of a few streams on a GPU is bound by the host: building the step's graph
in Python took 1.7-3.2 ms of an 8B's 7-10 ms step on the H200 (``served_step.py``'s build
column), a few microseconds for each of the ~20 module calls and operations of each of
its 32 blocks. ``mx.compile`` traces a function once per input shape and replays it from
C++ after: a block's work before the KV cache (its norm, the queries, keys and values,
their rotation) and after the attention (the output projection, both residual adds, the
second norm, the MLP) are each one compiled call, and only the cache update and the
attention stay Python (they read the cache, whose length grows every step). Here, on
the CPU, an element-wise chain of 20 operations took 17 us to build and 1.9 us as a
compiled call, a quantized block's MLP half 13.4 and 4.5.

Each piece is traced per decode width (its inputs' shapes: the hidden state, the
batch's positions, the attention's output; not the context length), the first time a
width runs (the warm-up runs every width); the load's tuners time steps with the
pieces and have them traced again after each change, and once more with the paths
they chose, which the traces then keep. Only one-token steps over a batch cache (whose
position is an ``int32`` array, as the engine's generator uses) take it; prompt steps
and anything else run the block as it was. Only the block classes of :data:`FAMILIES`
whose attention has :mod:`one_token`'s path; where :mod:`add_norm_cuda` fused a block's
adds and norms, its pieces call that kernel and hand the block's output on in two parts,
as the fused block does (:func:`fused_pieces`). The same operations in the same
order: the tests compare the logits bit for bit against the block uncompiled (on the
CPU, where MLX builds a norm and a rotation from several operations, compiling fuses
them too). On by default on the CPU backend and on CUDA, where it measured faster: on
the CPU a 32-block model's one-stream step took 19-23 ms against 26-30; on the H200, an
8B Q4_K_M served 1.13-1.28x at one stream and 1.16-1.23x at 32 in two alternating pairs
(``benchmarks/RESULTS.md``). Off on Metal until measured there (``GMLX_COMPILE_BLOCKS=1``
turns it on, ``0`` off anywhere).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import mlx.core as mx

from gmlx.engine.kernels import glu_cuda, one_token, qkv_cuda, swaps, traces
from gmlx.engine.kernels.fast_linear import plus

ENV = "GMLX_COMPILE_BLOCKS"
FAMILIES = ("llama", "qwen2", "qwen3", "phi3")  # h = x + attn(norm(x)); h + mlp(norm(h))


def enabled() -> bool:
    """``GMLX_COMPILE_BLOCKS=1`` on, ``0`` off; unset, on where it measured faster (the
    CPU backend, CUDA) and off on Metal (not yet measured there)."""
    from gmlx.engine.capacity import backend

    value = os.environ.get(ENV, "auto")
    return value == "1" or (value == "auto" and backend() in ("cpu", "cuda"))


def attach(model: Any) -> int:
    """Give ``model``'s llama-pattern blocks whose attention has the one-token path the
    compiled one-token step (blocks :mod:`add_norm_cuda` fused too); returns how many
    changed."""
    blocks = _block_classes()
    changed = 0
    for _, module in model.named_modules():
        cls = type(module)
        pattern = cls in blocks or (vars(cls).get("add_norm") and cls.__bases__[0] in blocks)
        if pattern and vars(type(module.get("self_attn"))).get("one_token"):
            module.__class__ = _compiled_block(type(module))
            object.__setattr__(module, traces.PIECES, None)
            changed += 1
    return changed


attached = traces.attached
retrace = traces.retrace


def detach(model: Any) -> None:
    """Give the blocks their own classes back."""
    swaps.restore(model, traces.MARKER)


@cache
def _block_classes() -> frozenset[type]:
    return swaps.family_classes(FAMILIES, "TransformerBlock")


def pieces(block: Any) -> tuple[Any, Any]:
    """``block``'s compiled pieces: ``before(x, offset) -> (queries, keys, values)`` and
    ``after(x, attended) -> the block's output``."""
    attention = block.self_attn

    def before(x: Any, offset: Any) -> tuple[Any, Any, Any]:  # (the norm in the product's kernel where it can)
        return qkv_cuda.normed_queries_keys_values(attention, block.input_layernorm, x, offset)

    def after(x: Any, attended: Any) -> Any:
        h = plus(attention.o_proj, attended, x)  # (the residual in the product's kernel where it can)
        return glu_cuda.normed_plus(block.mlp, block.post_attention_layernorm, h)  # (the norm too)

    return mx.compile(before), mx.compile(after)


def fused_pieces(block: Any) -> tuple[Any, Any, Any]:
    """The compiled pieces of a block :mod:`add_norm_cuda` fused, whose residual adds and
    norms are one kernel each (``block._add_norm``): ``first(x, offset) -> (queries,
    keys, values)`` for the first block (its input the embedding), ``joined(h, r, offset)
    -> (h, queries, keys, values)`` for the others (the last block's output as its two
    parts, added and normed in one kernel), ``after(h, attended) -> (h, r)``: the two
    parts of the block's output, which the next block (or the final norm) adds itself."""
    attention, fused = block.self_attn, block._add_norm
    norm1, norm2 = block.input_layernorm, block.post_attention_layernorm

    def first(x: Any, offset: Any) -> tuple[Any, Any, Any]:
        return one_token.queries_keys_values(attention, norm1(x), offset)

    def joined(h: Any, r: Any, offset: Any) -> tuple[Any, Any, Any, Any]:
        h, n = fused(h, r, norm1.weight, norm1.eps)
        return (h, *one_token.queries_keys_values(attention, n, offset))

    def after(h: Any, attended: Any) -> tuple[Any, Any]:
        h, n = fused(h, attention.o_proj(attended), norm2.weight, norm2.eps)
        return h, block.mlp(n)

    return mx.compile(first), mx.compile(joined), mx.compile(after)


def _batch_offset(x: Any, cache: Any) -> Any:
    """The positions of a one-token step over a batch cache (an ``int32`` array), or None
    for any other call (a prompt step, a single sequence's cache: the block's own code)."""
    offset = None if cache is None else cache.offset
    if x.shape[1] != 1 or not isinstance(offset, mx.array) or offset.dtype != mx.int32:
        return None
    return offset


def _traced(block: Any, make: Any) -> Any:
    """``block``'s compiled pieces, made by ``make(block)`` at the first call after
    :func:`traces.retrace` (or :func:`attach`)."""
    traced = getattr(block, traces.PIECES)
    if traced is None:
        traced = make(block)
        object.__setattr__(block, traces.PIECES, traced)
    return traced


@cache
def _compiled_block(cls: type) -> type:
    """``cls`` whose one-token steps over a batch cache run in two compiled pieces."""
    if vars(cls).get("add_norm"):
        return _compiled_fused_block(cls)

    def __call__(self: Any, x: Any, mask: Any = None, cache: Any = None) -> Any:
        if (offset := _batch_offset(x, cache)) is None:
            return cls.__call__(self, x, mask, cache)
        before, after = _traced(self, pieces)
        queries, keys, values = before(x, offset)
        return after(x, one_token.attend(self.self_attn, queries, keys, values, mask, cache))

    return swaps.subclass(cls, traces.MARKER, __call__)


@cache
def _compiled_fused_block(cls: type) -> type:
    """``cls`` (a block :mod:`add_norm_cuda` fused) whose one-token steps over a batch
    cache run in its compiled pieces (:func:`fused_pieces`), handing its output on to the
    next block in two parts, as the fused block does."""
    from gmlx.engine.kernels import add_norm_cuda

    def __call__(self: Any, x: Any, mask: Any = None, cache: Any = None) -> Any:
        offset = _batch_offset(x, cache)
        if offset is None or not add_norm_cuda.supports(x, self.input_layernorm.weight):
            return cls.__call__(self, x, mask, cache)  # it takes the last block's parts itself
        parts = add_norm_cuda.take(x)
        first, joined, after = _traced(self, fused_pieces)
        if parts is None:
            h, (queries, keys, values) = x, first(x, offset)
        else:
            h, queries, keys, values = joined(*parts, offset)
        h, r = after(h, one_token.attend(self.self_attn, queries, keys, values, mask, cache))
        return add_norm_cuda.hand_on(h, r)

    return swaps.subclass(cls, traces.MARKER, __call__)
