"""A one-token step's attention in fewer operations, for mlx-lm's llama-pattern models.

mlx-lm's attention (llama, and mistral's models through it, qwen2, qwen3, gemma3's text
model, phi3) reshapes each of the queries, keys and values to ``(B, L, heads, D)`` and
transposes it to ``(B, heads, L, D)``, and the attention's output back the other way.
With one token a stream (``L = 1``, every decode step) a transpose moves nothing: ``(B,
1, heads, D)`` and ``(B, heads, 1, D)`` hold their elements in the same order, so each
reshape-and-transpose is one reshape, and the output's transpose-and-reshape one reshape:
four operations fewer a layer (an 8B's step: 128 of its ~870), the same arrays, element
for element (the tests compare the logits bit for bit, on padded batches, rotating and
quantized caches too).

A decode step of a few streams on a GPU is bound by the host, at a few microseconds an
operation built and handed to MLX, whatever the operation does; these do nothing.
Prompt steps (``L > 1``) and calls without a cache run the model's own code. Only the
attention classes named in :data:`FAMILIES` change (their ``__class__``, not their
parameters); ``GMLX_ONE_TOKEN_ATTENTION=0`` leaves every model as mlx-lm wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from gmlx.engine.kernels import cached_attention_cuda, rope_cuda, swaps
from gmlx.engine.kernels.step_tuning import MAX_ROWS as MAX_PROJECTED
from gmlx.engine.kernels.step_tuning import bucket
from gmlx.engine.mlxlm import kv_used

ENV = "GMLX_ONE_TOKEN_ATTENTION"
# mlx-lm modules whose ``Attention.__call__`` is the pattern above: qwen3 and gemma3 add a
# norm of each head's queries and keys over its last axis (the same with one token either
# way), phi3 splits one q/k/v product (a family that norms before the reshape, olmo2's,
# is not the pattern)
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "phi3")


def enabled() -> bool:
    """Whether ``GMLX_ONE_TOKEN_ATTENTION`` leaves the one-token path on (the default)."""
    return os.environ.get(ENV, "1") != "0"


def attach(model: Any, rotation: Callable[[Any], Any] | None = None, in_place: bool | None = None,
           fold: bool | None = None) -> int:
    """Give every attention of ``model`` whose class is one of :data:`FAMILIES`' the
    one-token path; returns how many changed (0 when turned off). ``rotation`` makes a
    layer's ``rotate(q, k, offset)`` (its queries and keys from the projections, rotated
    and shaped for the attention) or None for it; by default, with ``GMLX_ROPE_KERNEL=1``
    on CUDA, :func:`rope_cuda.rotation`. With ``in_place`` (by default on CUDA) the
    attention writes the cache in place (:func:`cached_attention_cuda.attend_cached`), and
    with ``fold`` too (by default, unless ``GMLX_ROPE_ATTENTION=0``) it also rotates the queries
    and key itself where the layer's rope allows (:func:`cached_attention_cuda.folded_rope`)."""
    if not enabled():
        return 0
    if rotation is None and rope_cuda.enabled():
        rotation = rope_cuda.rotation
    if in_place is None:
        in_place = cached_attention_cuda.cached_enabled()
    if fold is None:
        fold = cached_attention_cuda.fold_enabled()
    classes = _classes()
    changed = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in classes:
            module.__class__ = _one_token(cls)
            object.__setattr__(module, "_rotate", None if rotation is None else rotation(module))
            object.__setattr__(module, "_project", None)  # qkv_cuda's, where it gives one
            object.__setattr__(module, "_in_place", in_place)  # cached_attention_cuda.attend_cached
            # the rope the in-place attention takes (inverse frequencies, pairs), or None
            object.__setattr__(module, "_fold", cached_attention_cuda.folded_rope(module) if in_place and fold else None)
            changed += 1
    return changed


def detach(model: Any) -> None:
    """Give ``model``'s attention layers their own classes back (what :func:`attach`
    changed; a benchmark's loops compare the two on one model)."""
    swaps.restore(model, "one_token")


@cache
def _classes() -> frozenset[type]:
    return swaps.family_classes(FAMILIES, "Attention")


def queries_keys_values(attention: Any, x: Any, offset: Any) -> tuple[Any, Any, Any]:
    """A one-token step's queries, keys and values from ``x`` (``(B, 1, hidden)``) at the
    cache position ``offset``, each shaped ``(B, heads, 1, D)`` for the cache and the
    attention: projected (in one product where qkv_cuda gave the layer one for ``B``
    streams), the queries and keys normed per head where the family does and rotated (in
    one kernel where the layer has one and the offset is a batch's ``int32`` array),
    except where the layer's in-place attention takes its rope (``_fold``): those are
    left unrotated, and :func:`attend` rotates them where that attention is not taken.
    ``attention`` is a layer :func:`attach` changed."""
    B = x.shape[0]
    project = attention._project
    if project is not None and B <= MAX_PROJECTED and bucket(B) in attention._project_buckets:
        queries, keys, values = project(attention, x, B)  # one product (qkv_cuda)
    elif "qkv_proj" in attention:  # phi3
        q_end = attention.n_heads * attention.head_dim
        queries, keys, values = mx.split(attention.qkv_proj(x),
                                         [q_end, q_end + attention.n_kv_heads * attention.head_dim], axis=-1)
    else:
        queries, keys, values = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    return shaped(attention, queries, keys, values, offset)


def shaped(attention: Any, queries: Any, keys: Any, values: Any, offset: Any) -> tuple[Any, Any, Any]:
    """A one-token step's projected queries, keys and values (each ``(B, 1, width)``, or
    already ``(B, heads, 1, D)`` where :mod:`qkv_cuda`'s product wrote them so: their
    reshapes here are then no operation at all) as :func:`queries_keys_values` hands them
    on: shaped per head, normed and rotated."""
    values = per_head(values, attention.n_kv_heads)
    if attention._fold is not None:  # the in-place attention rotates them (or attend, where it is not taken)
        return per_head(queries, attention.n_heads), per_head(keys, attention.n_kv_heads), values
    rotate = attention._rotate
    if rotate is not None and isinstance(offset, mx.array) and offset.dtype == mx.int32:
        queries, keys = rotate(queries, keys, offset)  # one kernel: reshaped and rotated
    else:
        queries = per_head(queries, attention.n_heads)
        keys = per_head(keys, attention.n_kv_heads)
        if "q_norm" in attention:
            queries, keys = attention.q_norm(queries), attention.k_norm(keys)
        queries = attention.rope(queries, offset=offset)
        keys = attention.rope(keys, offset=offset)
    return queries, keys, values


def per_head(a: Any, heads: int) -> Any:
    """One token a stream, ``(B, 1, heads * D)``, as ``(B, heads, 1, D)``; ``a`` itself
    where it is that already (MLX puts a reshape into the graph even to the same shape
    where a dimension is left to it, ``-1``)."""
    return a if a.ndim == 4 else a.reshape(a.shape[0], heads, 1, -1)


def attend(attention: Any, queries: Any, keys: Any, values: Any, mask: Any, cache: Any) -> Any:
    """The keys and values into ``cache``, and the queries' attention over all it holds,
    shaped ``(B, 1, heads * D)`` for the output projection: in one kernel that writes
    them in place where the layer was given it (:func:`attach`'s ``in_place``) and the
    cache is a batch's that takes it (``write_and_attend``). A layer whose rope that
    kernel takes (``_fold``) hands it the queries and keys unrotated, with each stream's
    position; where the kernel is not taken, they are rotated here first by the layer's
    own rope."""
    write = getattr(cache, "write_and_attend", None) if attention._in_place else None
    in_place = (write is not None and cache.keys is not None
                and cached_attention_cuda.supports_cached(queries, keys, values, cache.keys, cache.values, mask,
                                                          0 if mask is None else kv_used(cache) + 1))
    fold, offset = attention._fold, cache.offset
    if fold is not None and not (in_place and isinstance(offset, mx.array) and offset.dtype == mx.int32
                                 and offset.shape == (queries.shape[0],)):
        queries, keys = attention.rope(queries, offset=offset), attention.rope(keys, offset=offset)
        fold = None
    if in_place:
        scale = attention.scale
        rope = None if fold is None else (offset, *fold)
        return write(lambda k, v, padding, position: cached_attention_cuda.attend_cached(
            queries, keys, values, k, v, padding, position, scale, rope=rope))
    keys, values = cache.update_and_fetch(keys, values)
    # through the module, so a routed attention (attention_cuda) is the one called
    out = base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attention.scale, mask=mask)
    return out.reshape(out.shape[0], 1, -1)


@cache
def _one_token(cls: type) -> type:
    """``cls`` with a one-token step in fewer operations."""

    def __call__(self: Any, x: Any, mask: Any = None, cache: Any = None) -> Any:
        if x.shape[1] != 1 or cache is None:
            return cls.__call__(self, x, mask, cache)
        queries, keys, values = queries_keys_values(self, x, cache.offset)
        return self.o_proj(attend(self, queries, keys, values, mask, cache))

    return swaps.subclass(cls, "one_token", __call__)
