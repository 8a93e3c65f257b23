"""A one-token step's queries and keys rotated in one CUDA kernel, straight from the
projections.

In a one-token step (:mod:`one_token`) the queries and keys are each reshaped to
``(B, heads, 1, D)`` and rotated by MLX's rope: four operations a layer, two of them
kernels, in a step bound by the host. Here one kernel reads both projections as they
come, ``(B, 1, heads * D)``, and writes both rotated, ``(B, heads, 1, D)``: one
operation. Position ``p`` of stream ``b`` is the cache's offset for it (an array: the
batch caches the worker decodes on); angle ``p * inv[i]`` for each of the ``D / 2``
pairs, in float32, pairs ``(i, i + D/2)`` or, for traditional rope, ``(2i, 2i + 1)``.
``inv`` comes from the model's own rope module: ``scale / base^(2i / D)`` for
``nn.RoPE``, ``1 / freqs[i]`` for llama 3's (:func:`inverse_frequencies`); any other rope,
a partial rotation, a per-head norm before the rope (qwen3's) or an offset that is a
plain number keep MLX's.

One thread per (stream, head, pair). Only built on CUDA; off unless
``GMLX_ROPE_KERNEL=1`` until measured on a GPU (``pipeline_check.py``'s ``rope`` loop).
The tests run its own source on the CPU with CUDA's block primitives emulated, against
MLX's rope, and the wiring through real models with MLX's reshapes and rope standing in.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from mlx import nn

from gmlx.engine.kernels import cuda_source
from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

ENV = "GMLX_ROPE_KERNEL"
THREADS = 128

_SOURCE = """
const int half = D / 2;
const int heads = H + HK;
const int i = blockIdx.x * THREADS + threadIdx.x;
const int B = off_shape[0];
if (i >= B * heads * half) return;
const int j = i % half;
const int h = (i / half) % heads;
const int b = i / (half * heads);
const float angle = static_cast<float>(off[b]) * inv[j];
float s, c;
sincosf(angle, &s, &c);
const int a0 = TRAD ? 2 * j : j;
const int a1 = TRAD ? 2 * j + 1 : j + half;
const bool query = h < H;
const size_t row = query ? (size_t)(b * H + h) * D : (size_t)(b * HK + h - H) * D;
const T* src = (query ? q : k) + row;
T* dst = (query ? qo : ko) + row;
const float x0 = static_cast<float>(src[a0]);
const float x1 = static_cast<float>(src[a1]);
dst[a0] = static_cast<T>(x0 * c - x1 * s);
dst[a1] = static_cast<T>(x0 * s + x1 * c);
"""
_BODY = compact(_SOURCE)


def enabled() -> bool:
    """Whether ``GMLX_ROPE_KERNEL=1`` and MLX runs on CUDA here."""
    return os.environ.get(ENV, "0") == "1" and cuda_source.available()


def inverse_frequencies(rope: Any, head_dim: int) -> tuple[Any, bool] | None:
    """``(inv, traditional)`` for a rope module the kernel can stand in for (it rotates
    every dimension of the head), else None."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import Llama3RoPE

    if type(rope) is nn.RoPE and rope.dims == head_dim:
        exponents = mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim
        return rope.scale / (rope.base ** exponents), rope.traditional
    if type(rope) is Llama3RoPE and rope.dims == head_dim:
        return 1.0 / rope._freqs.astype(mx.float32), rope.traditional
    return None


@cache
def _kernel(dtype: Any, heads: int, kv_heads: int, head_dim: int, traditional: bool) -> Any:
    """One kernel per float type, head counts, head size and pairing (:mod:`cuda_source`)."""
    head = (f"using T = {cuda_type(dtype)}; constexpr int H = {heads}; constexpr int HK = {kv_heads}; "
            f"constexpr int D = {head_dim}; constexpr int THREADS = {THREADS}; "
            f"constexpr bool TRAD = {'true' if traditional else 'false'};\n")
    return build(f"gmlx_rope_{heads}_{kv_heads}_{head_dim}", head, _BODY, ["q", "k", "off", "inv"],
                 outputs=("qo", "ko"))


def rope_qk(q: Any, k: Any, offset: Any, inv: Any, heads: int, kv_heads: int, traditional: bool) -> tuple[Any, Any]:
    """The queries ``(B, 1, heads * D)`` and keys ``(B, 1, kv_heads * D)`` of a one-token
    step, rotated for positions ``offset`` (int32, one per stream), as ``(B, heads, 1,
    D)`` and ``(B, kv_heads, 1, D)``."""
    b = q.shape[0]
    d = q.shape[-1] // heads
    threads = b * (heads + kv_heads) * (d // 2)
    qo, ko = _kernel(q.dtype, heads, kv_heads, d, traditional)(
        inputs=[q, k, offset, inv], grid=(-(-threads // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, heads, 1, d), (b, kv_heads, 1, d)], output_dtypes=[q.dtype, q.dtype])
    return qo, ko


def rotation(attention: Any) -> Any:
    """``rotate(q, k, offset)`` through the kernel for one of :mod:`one_token`'s
    attention layers, or None where it keeps MLX's (another rope, a partial rotation, a
    per-head norm before the rope, one q/k/v product)."""
    if not rotation_applies(attention):
        return None
    inv, traditional = inverse_frequencies(attention.rope, attention.rope.dims)
    heads, kv_heads = attention.n_heads, attention.n_kv_heads

    def rotate(q: Any, k: Any, offset: Any) -> tuple[Any, Any]:
        return rope_qk(q, k, offset, inv, heads, kv_heads, traditional)

    return rotate


def mlx_rotation(attention: Any) -> Any:
    """What :func:`rotation`'s function computes, in MLX's reshapes and the layer's own
    rope (the model's code), for the same layers."""
    if not rotation_applies(attention):
        return None
    rope, heads, kv_heads = attention.rope, attention.n_heads, attention.n_kv_heads

    def rotate(q: Any, k: Any, offset: Any) -> tuple[Any, Any]:
        b = q.shape[0]
        return rope(q.reshape(b, heads, 1, -1), offset=offset), rope(k.reshape(b, kv_heads, 1, -1), offset=offset)

    return rotate


def rotation_applies(attention: Any) -> bool:
    """Whether :func:`rotation` would give ``attention`` the kernel."""
    return ("q_norm" not in attention and "qkv_proj" not in attention
            and inverse_frequencies(attention.rope, getattr(attention.rope, "dims", 0)) is not None)
