"""A one-token step's queries and keys rotated in one CUDA kernel, straight from the
projections.

In a one-token step (:mod:`one_token`) the queries and keys are each reshaped to
``(B, heads, 1, D)`` and rotated by MLX's rope: four operations a layer (six where each
head is normalized first, as qwen3 does), in a step bound by the host. Here one kernel
reads both projections as they come, ``(B, 1, heads * D)``, normalizes each head if the
layer does, and writes both rotated, ``(B, heads, 1, D)``: one operation. Position ``p``
of stream ``b`` is the cache's offset for it (an array: the batch caches the worker
decodes on); angle ``p * inv[i]`` for each of the ``D / 2`` pairs, in float32, pairs
``(i, i + D/2)`` or, for traditional rope, ``(2i, 2i + 1)``. ``inv`` comes from the
model's own rope module: ``scale / base^(2i / D)`` for ``nn.RoPE``, ``1 / freqs[i]`` for
llama 3's (:func:`inverse_frequencies`). A head's norm is MLX's RMSNorm as its CUDA kernel
rounds it (``w * T(x * rsqrt(mean(x^2) + eps))``). Any other rope or norm, a partial
rotation, one q/k/v product (phi3) or an offset that is a plain number keep MLX's.

One warp per (stream, head), each lane a few pairs (head sizes 64, 128, 256). Only built
on CUDA; off unless ``GMLX_ROPE_KERNEL=1`` until measured on a GPU
(``pipeline_check.py``'s ``rope`` loop). The tests run its own source on the CPU with
CUDA's block primitives emulated, against MLX's norm and rope, and the wiring through
real models with MLX's reshapes, norms and rope standing in.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from mlx import nn

from gmlx.engine.kernels import cuda_source
from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

ENV = "GMLX_ROPE_KERNEL"
THREADS = 128  # four warps: four heads a block
HEAD_DIMS = (64, 128, 256)  # whole pairs for every lane

# One warp per (stream, head): each lane takes pairs lane, lane + 32, ... of the head.
_LOAD = """
constexpr int PAIRS = D / 64;
const int lane = threadIdx.x & 31;
const int item = (blockIdx.x * THREADS + threadIdx.x) >> 5;
const int heads = H + HK;
const int B = off_shape[0];
if (item >= B * heads) return;
const int h = item % heads;
const int b = item / heads;
const bool query = h < H;
const size_t row = query ? (size_t)(b * H + h) * D : (size_t)(b * HK + h - H) * D;
const T* src = (query ? q : k) + row;
T* dst = (query ? qo : ko) + row;
int a0[PAIRS], a1[PAIRS];
float x0[PAIRS], x1[PAIRS];
#pragma unroll
for (int t = 0; t < PAIRS; ++t) {
    const int j = lane + 32 * t;
    a0[t] = TRAD ? 2 * j : j;
    a1[t] = TRAD ? 2 * j + 1 : j + D / 2;
    x0[t] = static_cast<float>(src[a0[t]]);
    x1[t] = static_cast<float>(src[a1[t]]);
}
"""
# qwen3's per-head RMSNorm before the rope, rounded as MLX's norm rounds (w * T(x * r))
_NORM = """
float ss = 0.0f;
#pragma unroll
for (int t = 0; t < PAIRS; ++t) ss += x0[t] * x0[t] + x1[t] * x1[t];
#pragma unroll
for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
const float r = rsqrtf(ss / D + EPS);
const T* w = query ? qw : kw;
#pragma unroll
for (int t = 0; t < PAIRS; ++t) {
    x0[t] = static_cast<float>(static_cast<T>(static_cast<float>(w[a0[t]]) * static_cast<float>(static_cast<T>(x0[t] * r))));
    x1[t] = static_cast<float>(static_cast<T>(static_cast<float>(w[a1[t]]) * static_cast<float>(static_cast<T>(x1[t] * r))));
}
"""
# every load before the first store (the outputs may alias the inputs as far as the
# compiler knows: a load after a store would wait for it)
_ROTATE = """
const float p = static_cast<float>(off[b]);
float f[PAIRS];
#pragma unroll
for (int t = 0; t < PAIRS; ++t) f[t] = inv[lane + 32 * t];
#pragma unroll
for (int t = 0; t < PAIRS; ++t) {
    float sn, cs;
    sincosf(p * f[t], &sn, &cs);
    dst[a0[t]] = static_cast<T>(x0[t] * cs - x1[t] * sn);
    dst[a1[t]] = static_cast<T>(x0[t] * sn + x1[t] * cs);
}
"""


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
def _kernel(dtype: Any, heads: int, kv_heads: int, head_dim: int, traditional: bool, eps: float | None) -> Any:
    """One kernel per float type, head counts, head size, pairing and norm (``eps``, or
    None for none) (:mod:`cuda_source` says why)."""
    head = (f"using T = {cuda_type(dtype)}; constexpr int H = {heads}; constexpr int HK = {kv_heads}; "
            f"constexpr int D = {head_dim}; constexpr int THREADS = {THREADS}; "
            f"constexpr bool TRAD = {'true' if traditional else 'false'};"
            + ("" if eps is None else f" constexpr float EPS = {float(eps)!r}f;") + "\n")
    body = compact(_LOAD + ("" if eps is None else _NORM) + _ROTATE)
    inputs = ["q", "k", "off", "inv", *(() if eps is None else ("qw", "kw"))]
    return build(f"gmlx_rope_{heads}_{kv_heads}_{head_dim}", head, body, inputs, outputs=("qo", "ko"))


def rope_qk(q: Any, k: Any, offset: Any, inv: Any, heads: int, kv_heads: int, traditional: bool,
            norms: tuple[Any, Any, float] | None = None) -> tuple[Any, Any]:
    """The queries ``(B, 1, heads * D)`` and keys ``(B, 1, kv_heads * D)`` of a one-token
    step (or the same elements already shaped per head, as :mod:`qkv_cuda`'s products
    write them), each head normalized first with ``norms`` (the query and key norms' weights
    and epsilon) if given, rotated for positions ``offset`` (int32, one per stream), as
    ``(B, heads, 1, D)`` and ``(B, kv_heads, 1, D)``."""
    b = q.shape[0]
    d = q.size // (b * heads)
    warps = b * (heads + kv_heads)
    inputs = [q, k, offset, inv, *(() if norms is None else norms[:2])]
    qo, ko = _kernel(q.dtype, heads, kv_heads, d, traditional, None if norms is None else norms[2])(
        inputs=inputs, grid=(-(-warps * 32 // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, heads, 1, d), (b, kv_heads, 1, d)], output_dtypes=[q.dtype, q.dtype])
    return qo, ko


def rotation(attention: Any) -> Any:
    """``rotate(q, k, offset)`` through the kernel for one of :mod:`one_token`'s
    attention layers, or None where it keeps MLX's (another rope or norm, a partial
    rotation, one q/k/v product)."""
    if not rotation_applies(attention):
        return None
    import mlx.core as mx

    rope = attention.rope
    inv, traditional = inverse_frequencies(rope, rope.dims)
    mx.eval(inv)  # computed once here, not in the first step's graph
    heads, kv_heads = attention.n_heads, attention.n_kv_heads
    norms = None
    if "q_norm" in attention:
        qn, kn = attention.q_norm, attention.k_norm
        norms = (qn.weight, kn.weight, qn.eps)

    def rotate(q: Any, k: Any, offset: Any) -> tuple[Any, Any]:
        return rope_qk(q, k, offset, inv, heads, kv_heads, traditional, norms)

    return rotate


def mlx_rotation(attention: Any) -> Any:
    """What :func:`rotation`'s function computes, in MLX's reshapes, the layer's own
    norms and rope (the model's code), for the same layers."""
    if not rotation_applies(attention):
        return None
    rope, heads, kv_heads = attention.rope, attention.n_heads, attention.n_kv_heads
    normed = "q_norm" in attention

    def rotate(q: Any, k: Any, offset: Any) -> tuple[Any, Any]:
        b = q.shape[0]
        q, k = q.reshape(b, heads, 1, -1), k.reshape(b, kv_heads, 1, -1)
        if normed:
            q, k = attention.q_norm(q), attention.k_norm(k)
        return rope(q, offset=offset), rope(k, offset=offset)

    return rotate


def rotation_applies(attention: Any) -> bool:
    """Whether :func:`rotation` would give ``attention`` the kernel: its rope one the
    kernel stands in for over whole heads of 64, 128 or 256, and its per-head norms, if
    any, plain RMSNorms with one epsilon (qwen3's)."""
    rope = attention.rope
    dims = getattr(rope, "dims", 0)
    if "qkv_proj" in attention or dims not in HEAD_DIMS or inverse_frequencies(rope, dims) is None:
        return False
    if "q_norm" in attention:
        qn, kn = attention.q_norm, attention.k_norm
        return type(qn) is nn.RMSNorm and type(kn) is nn.RMSNorm and qn.eps == kn.eps
    return True
