"""One-query attention over a padded batch, for CUDA: a decode step's attention when
some stream's keys start after padding.

MLX's CUDA attention runs a one-token step in one kernel only without a mask array; a
batch whose streams joined at different steps carries a left-padding mask (mlx-lm's
batch KV cache), so each layer of such a step took MLX's general path instead (a few
products, a softmax and the mask's own conversion: on the H200 an 8B bf16 step at width
32 took 16.0 ms masked against 11.5 unmasked, nearly all host time). This kernel takes
the boolean mask of shape ``(B, 1, 1, keys)`` as it is and skips the masked keys.

One block of 256 threads per (stream, query head), or over many keys several, each
taking every n-th tile, their shares combined by a second kernel (:func:`splits`). Keys
go by in tiles of 256: each thread scores one key of the tile (its dot product with the
query, in float32, times ``scale * log2(e)``), the block takes the tile's maximum and
the running softmax is rescaled by ``exp2(old max - new max)``; then each warp adds
every eighth key's values weighted by ``exp2(score - max)``, each lane ``D / 32``
dimensions in one wide load (the first form's groups of ``D`` threads, one dimension
each, made every thread a chain of dependent loads), and the warps' sums meet in shared
memory. Masked keys weigh nothing. The keys and values are read through their strides, so
the cache's views (``keys[..., :used, :]``) are never copied; grouped-query heads share
their key-value head. Used only where built (CUDA) and where the step's mask allows it
(:func:`supports`); ``GMLX_ATTENTION_KERNEL=0`` turns it off (:func:`enabled`). On the H200
(``benchmarks/gpu/attention_check.py``, 2026-12-03) it agreed with attention in float32
more closely than MLX's masked path (largest difference 0.0005-0.0018 in bf16 against
MLX's 0.0012-0.0081) and took 1.2-4.5x less time a call (8 streams, 2,100 keys: 147 us
against 184; 32 streams, 300 keys: 65 against 116); an 8B bf16 step at width 32 through
mlx-lm's masked cache took 8.62 ms routed here against 11.43. The tests compile its
source for sm_90 with nvcc as MLX wraps it, run that source itself on the CPU (each
block as 256 host threads, CUDA's barriers and shuffles emulated) and its arithmetic as
a numpy replay (:func:`replay`), each against MLX's masked attention.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import cache
from typing import Any

from gmlx.engine.kernels import cuda_source
from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

THREADS = 256
HEAD_DIMS = (64, 128, 256)
_FLOOR = -3.0e38  # the score of a masked key (finite: no inf - inf)

# A tile's softmax step: each thread's score ``s`` (``FLOOR`` where
# its key is not ``live``), the block's running maximum ``m`` and total, and each
# thread's weight ``ps[t]`` for the values; ``corr`` rescales what was summed before.
_TILE = """    float w = s;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
    if (lane == 0) red[warp] = w;
    __syncthreads();
    float top = red[0];
    #pragma unroll
    for (int i = 1; i < THREADS / 32; ++i) top = fmaxf(top, red[i]);
    const float mn = fmaxf(m, top);
    __syncthreads();
    const float p = live ? exp2f(s - mn) : 0.0f;
    ps[t] = p;
    float sum = p;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    float tile = 0.0f;
    #pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) tile += red[i];
    const float corr = exp2f(m - mn);
    total = total * corr + tile;
"""

# The values, a key a warp: key ``jj``'s values weighted by ``pi`` into this
# lane's ``VEC`` dimensions (``acc``), in one load of 4, 8 or 16 bytes where the values
# are dense (``vdense``), else one a dimension.
_ADD_VALUES = """            const T* vr = vb + (int64_t)jj * v_strides[2];
            if (vdense && VEC == 2) {
                const uint32_t raw = *reinterpret_cast<const uint32_t*>(vr + lane * VEC);
                const T* x = reinterpret_cast<const T*>(&raw);
                acc[0] += pi * static_cast<float>(x[0]);
                acc[1 % VEC] += pi * static_cast<float>(x[1]);
            } else if (vdense && VEC == 4) {
                const uint2 raw = *reinterpret_cast<const uint2*>(vr + lane * VEC);
                const T* x = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int e = 0; e < 4; ++e) acc[e % VEC] += pi * static_cast<float>(x[e]);
            } else if (vdense) {
                const uint4 raw = *reinterpret_cast<const uint4*>(vr + lane * VEC);
                const T* x = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int e = 0; e < 8; ++e) acc[e % VEC] += pi * static_cast<float>(x[e]);
            } else {
                #pragma unroll
                for (int e = 0; e < VEC; ++e) acc[e] += pi * static_cast<float>(vr[(lane * VEC + e) * v_strides[3]]);
            }
"""

_SOURCE = """
constexpr int WARPS = THREADS / 32;
constexpr int VEC = D / 32;
__shared__ float qs[D];
__shared__ float ps[THREADS];
__shared__ float red[WARPS];
__shared__ float part[WARPS][D];
const int t = threadIdx.x;
const int lane = t & 31;
const int warp = t >> 5;
const int heads = q_shape[1];
const int splits = gridDim.x / (q_shape[0] * heads);
const int split = blockIdx.x % splits;
const int b = blockIdx.x / splits / heads;
const int h = blockIdx.x / splits % heads;
const int kvh = h / (heads / k_shape[1]);
const int keys = k_shape[2];
if (t < D) qs[t] = static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + t * q_strides[3]]) * QSCALE;
__syncthreads();
const T* kb = k + b * k_strides[0] + kvh * k_strides[1];
const T* vb = v + b * v_strides[0] + kvh * v_strides[1];
const bool* mb = mask + b * mask_strides[0];
const bool dense = k_strides[3] == 1;
const bool vdense = v_strides[3] == 1 && v_strides[2] % 8 == 0;
float m = FLOOR;
float total = 0.0f;
float acc[VEC];
#pragma unroll
for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
for (int j0 = split * THREADS; j0 < keys; j0 += THREADS * splits) {
    const int j = j0 + t;
    const bool live = j < keys && mb[j * mask_strides[3]];
    float s = FLOOR;
    if (live) {
        const T* kr = kb + j * k_strides[2];
        float dot = 0.0f;
        if (dense) {
            #pragma unroll
            for (int e = 0; e < D; e += 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(kr + e);
                const T* kv = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int i = 0; i < 8; ++i) dot += qs[e + i] * static_cast<float>(kv[i]);
            }
        } else {
            for (int e = 0; e < D; ++e) dot += qs[e] * static_cast<float>(kr[e * k_strides[3]]);
        }
        s = dot;
    }
""" + _TILE + """    #pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] *= corr;
    const int n = min(THREADS, keys - j0);
    #pragma unroll 4
    for (int i = warp; i < n; i += WARPS) {
        const float pi = ps[i];
        const int jj = j0 + i;
        if (pi != 0.0f) {
""" + _ADD_VALUES + """        }
    }
    m = mn;
    __syncthreads();
}
#pragma unroll
for (int e = 0; e < VEC; ++e) part[warp][lane * VEC + e] = acc[e];
__syncthreads();
if (t < D) {
    float r = 0.0f;
    #pragma unroll
    for (int i = 0; i < WARPS; ++i) r += part[i][t];
    FINISH(r);
}
"""

_BODY = compact(_SOURCE)


# How a block ends: with the keys in one block, its output; split
# over several blocks (each every ``splits``-th tile; how many, the launch's grid says,
# so one compiled kernel serves every count), its share (the values' sum ``pacc``
# unscaled, its running maximum ``pm`` and total ``pl``) for the combine below.
_FINISH_ONE = "#define FINISH(r) out[blockIdx.x * D + t] = static_cast<T>(total > 0.0f ? (r) / total : 0.0f)\n"
_FINISH_SPLIT = ("#define FINISH(r) { pacc[(size_t)blockIdx.x * D + t] = (r); "
                 "if (t == 0) { pm[blockIdx.x] = m; pl[blockIdx.x] = total; } }\n")

# The shares of a stream's head from its blocks (as many as ``pm`` holds a head),
# rescaled to their common maximum (base-2 scores, as the tiles keep them) and summed:
# one thread a dimension.
_COMBINE_SOURCE = """
const int t = threadIdx.x;
const int splits = pm_shape[0] / gridDim.x;
const int base = blockIdx.x * splits;
float top = FLOOR;
for (int i = 0; i < splits; ++i) top = fmaxf(top, pm[base + i]);
float total = 0.0f;
float r = 0.0f;
for (int i = 0; i < splits; ++i) {
    const float w = exp2f(pm[base + i] - top);
    total += pl[base + i] * w;
    r += pacc[(size_t)(base + i) * D + t] * w;
}
out[blockIdx.x * D + t] = static_cast<T>(total > 0.0f ? r / total : 0.0f);
"""
_COMBINE_BODY = compact(_COMBINE_SOURCE)
TARGET_BLOCKS = 1024  # blocks a long one-token attention is split into, about (the H100 and H200: 132 SMs)


def enabled() -> bool:
    """Whether a server's load routes attention to the kernel: on CUDA, unless
    ``GMLX_ATTENTION_KERNEL=0``."""
    return os.environ.get("GMLX_ATTENTION_KERNEL", "1") != "0" and cuda_source.available()


def supports(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None) -> bool:
    """Whether an attention call may take the kernel: one query per stream in fp16 or
    bf16, one head size for keys and values (64, 128 or 256), whole groups of query
    heads per key-value head, no sinks, and a boolean mask of shape ``(B, 1, 1, keys)``."""
    import mlx.core as mx

    if sinks is not None or not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[2] != 1:
        return False
    b, heads, _, d = q.shape
    return (q.dtype in (mx.float16, mx.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and d in HEAD_DIMS and k.shape[3] == d and v.shape[3] == d
            and k.shape[0] == b and v.shape[:3] == k.shape[:3] and heads % k.shape[1] == 0
            and tuple(mask.shape) == (b, 1, 1, k.shape[2]))


@cache
def _kernel(dtype: Any, head_dim: int, scale: float, split: bool = False) -> Any:
    """One kernel per float type, head size and scale (:mod:`cuda_source` says why),
    whole or ``split`` (a block's share of a head's keys, for :func:`_combine_kernel`)."""
    head = kernel_head(dtype, head_dim, scale) + (_FINISH_SPLIT if split else _FINISH_ONE)
    return build(f"gmlx_attend_{cuda_type(dtype).strip('_')}_{head_dim}{'_split' if split else ''}", head, _BODY,
                 ["q", "k", "v", "mask"], outputs=("pacc", "pm", "pl") if split else ("out",),
                 ensure_row_contiguous=False)


def kernel_head(dtype: Any, head_dim: int, scale: float, threads: int = THREADS) -> str:
    """A one-query attention kernel's constants: the float type, head size, block size, the scale in base 2."""
    qscale = float(scale) * math.log2(math.e)
    return (f"using T = {cuda_type(dtype)}; constexpr int D = {head_dim}; constexpr int THREADS = {threads}; "
            f"constexpr float QSCALE = {qscale!r}f; constexpr float FLOOR = {_FLOOR!r}f;\n")


def attend(q: Any, k: Any, v: Any, scale: float, mask: Any) -> Any:
    """``softmax(q k^T * scale, where mask) v`` for one query per stream: q ``(B, H, 1,
    D)``, k and v ``(B, Hkv, keys, D)``, mask ``(B, 1, 1, keys)`` (True: attend) ->
    ``(B, H, 1, D)``. Over many keys, each head's are split over several blocks
    (:func:`splits`) and a second launch combines them."""
    b, heads = q.shape[:2]
    return in_blocks(lambda split: _kernel(q.dtype, q.shape[-1], float(scale), split), [q, k, v, mask], q,
                     splits(b * heads, k.shape[2]), b * heads, q.shape)


def in_blocks(kernel: Callable[[bool], Any], inputs: list[Any], q: Any, n: int, blocks: int,
              out_shape: tuple[int, ...], threads: int = THREADS) -> Any:
    """A one-query attention kernel's launch, ``blocks`` blocks of ``threads`` (a block a
    (stream, query head) for the routed kernel, a (stream, key-value head) for the
    cached one), each over its whole share of the keys: ``kernel(False)`` alone, writing
    ``out_shape``; or, with ``n`` splits, ``kernel(True)``'s ``n`` times as many blocks
    each writing a share a (stream, query head, split), then :func:`_combine_kernel`
    over them."""
    import mlx.core as mx

    b, heads, _, d = q.shape
    grid, threadgroup = (blocks * n * threads, 1, 1), (threads, 1, 1)
    if n == 1:
        (out,) = kernel(False)(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=[out_shape],
                               output_dtypes=[q.dtype])
        return out
    shares = kernel(True)(inputs=inputs, grid=grid, threadgroup=threadgroup,
                          output_shapes=[(b * heads * n, d), (b * heads * n,), (b * heads * n,)],
                          output_dtypes=[mx.float32] * 3)
    (out,) = _combine_kernel(q.dtype, d)(inputs=list(shares), grid=(b * heads * d, 1, 1), threadgroup=(d, 1, 1),
                                         output_shapes=[out_shape], output_dtypes=[q.dtype])
    return out


@cache
def _combine_kernel(dtype: Any, head_dim: int) -> Any:
    head = f"using T = {cuda_type(dtype)}; constexpr int D = {head_dim}; constexpr float FLOOR = {_FLOOR!r}f;\n"
    return build(f"gmlx_attend_combine_{cuda_type(dtype).strip('_')}_{head_dim}", head, _COMBINE_BODY,
                 ["pacc", "pm", "pl"])


def splits(blocks: int, capacity: int) -> int:
    """Blocks each of ``blocks`` (streams x query heads) one-token attentions over a cache
    of ``capacity`` positions (the keys a routed call sees) is split into: toward
    ``TARGET_BLOCKS`` in all, each split at least two tiles of the capacity. A block's tiles run one after another, so one
    block a head over a long cache leaves most of the GPU idle (32 blocks at one stream
    of an 8B); short caches (the capacity of two tiles or less) stay in one block, one
    launch."""
    return max(1, min(-(-TARGET_BLOCKS // max(blocks, 1)), capacity // (2 * THREADS)))


def routed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``mx.fast.scaled_dot_product_attention`` (``original``) with the calls the kernel
    supports sent to it."""

    def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None,
                                     sinks: Any = None, **kwargs: Any) -> Any:
        if not kwargs and supports(q, k, v, mask, sinks):
            return attend(q, k, v, scale, mask)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(q, k, v, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def replay(q: Any, k: Any, v: Any, scale: float, mask: Any) -> Any:
    """The kernel's arithmetic in numpy (float32): the same tiles of 256 keys, base-2
    exponents, running maximum and rescaling, masked keys weighing nothing. For the
    tests, against MLX's own attention on the CPU."""
    import numpy as np

    q, k, v = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
    mask = np.asarray(mask, dtype=bool)
    b_n, heads, _, d = q.shape
    group = heads // k.shape[1]
    keys = k.shape[2]
    qscale = np.float32(scale * math.log2(math.e))
    out = np.zeros(q.shape, dtype=np.float32)
    for b in range(b_n):
        for h in range(heads):
            qs = q[b, h, 0] * qscale
            kr, vr = k[b, h // group], v[b, h // group]
            m, total, acc = np.float32(_FLOOR), np.float32(0), np.zeros(d, dtype=np.float32)
            for j0 in range(0, keys, THREADS):
                live = mask[b, 0, 0, j0 : j0 + THREADS]
                s = np.where(live, kr[j0 : j0 + THREADS] @ qs, np.float32(_FLOOR))
                mn = max(m, np.float32(s.max()))
                p = np.where(live, np.exp2(s - mn), 0).astype(np.float32)
                corr = np.float32(np.exp2(np.float32(m - mn)))
                total = total * corr + p.sum(dtype=np.float32)
                acc = acc * corr + p @ vr[j0 : j0 + THREADS]
                m = mn
            out[b, h, 0] = acc / total if total > 0 else 0
    return out
