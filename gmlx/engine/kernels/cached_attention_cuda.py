"""One-token attention over a batch cache in place, for CUDA: the step's new key and value
written into the cache's own arrays and attended over in one launch a layer
(:func:`attend_cached`), where mlx-lm's cache takes two slice updates, two views and the
attention, each an operation the host hands to MLX (on a GPU one stream's step is bound
by that host time; the whole-step trace this makes possible, :mod:`whole_step`, is the
served default on CUDA since 2026-12-05).

The same tiles and softmax as :mod:`attention_cuda`'s routed kernel (its ``TILE`` and
``ADD_VALUES`` snippets, its whole-or-split launch): each stream's keys from its padding
to the write position, the step's new key and value read from their own arrays at that
position and written into the cache there (by one block of each key-value head's group:
no block reads that position from the cache, so none waits for the write). Its values go
by a key a warp, each lane a few dimensions in one wide load (its first form, the groups
of D threads, each thread a long chain of dependent loads, took 1.5 ms more of an 8B's
one-stream step on the H200 than MLX's one-query kernel). The new key and value are
staged in shared memory by the block's first D threads, one coalesced load each: the
second form had the one thread whose key is the new one read all D of it from global
memory in a loop while the block waited for its score (19.5 us a call on an H100 at ~130
keys, where MLX's one-query kernel took 7 us at 300). Over a long cache each head's keys
are split over several blocks and combined (:func:`attention_cuda.splits`).

Used only where built (CUDA), where the step allows it (:func:`supports_cached`) and
``GMLX_CACHE_ATTENTION`` is not ``0`` (:func:`cached_enabled`). The tests run its source
on the CPU, each block as host threads, against MLX's attention, and compile it for
sm_90 with nvcc as MLX wraps it.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from gmlx.engine.kernels import attention_cuda, cuda_source
from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

_SOURCE = """
constexpr int WARPS = THREADS / 32;
constexpr int VEC = D / 32;
__shared__ float qs[D];
__shared__ float kns[D];
__shared__ float vns[D];
__shared__ float ps[THREADS];
__shared__ float red[WARPS];
__shared__ float part[WARPS][D];
const int t = threadIdx.x;
const int lane = t & 31;
const int warp = t >> 5;
const int heads = q_shape[1];
const int group = heads / k_shape[1];
const int splits = gridDim.x / (q_shape[0] * heads);
const int split = blockIdx.x % splits;
const int b = blockIdx.x / splits / heads;
const int h = blockIdx.x / splits % heads;
const int kvh = h / group;
const int at = position[0];
const int keys = at + 1;
const int first = padding[b * padding_strides[0]];
T* kb = const_cast<T*>(k) + b * k_strides[0] + kvh * k_strides[1];
T* vb = const_cast<T*>(v) + b * v_strides[0] + kvh * v_strides[1];
const T* kn = k_new + b * k_new_strides[0] + kvh * k_new_strides[1];
const T* vn = v_new + b * v_new_strides[0] + kvh * v_new_strides[1];
if (t < D) {
    qs[t] = static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + t * q_strides[3]]) * QSCALE;
    kns[t] = static_cast<float>(kn[t * k_new_strides[3]]);
    vns[t] = static_cast<float>(vn[t * v_new_strides[3]]);
}
__syncthreads();
const bool dense = k_strides[3] == 1 && k_strides[2] % 8 == 0;
const bool vdense = v_strides[3] == 1 && v_strides[2] % 8 == 0;
float m = FLOOR;
float total = 0.0f;
float acc[VEC];
#pragma unroll
for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
for (int j0 = (first / THREADS + split) * THREADS; j0 < keys; j0 += THREADS * splits) {
    const int j = j0 + t;
    const bool live = j >= first && j < keys;
    float s = FLOOR;
    if (live) {
        float dot = 0.0f;
        if (j == at) {
            #pragma unroll
            for (int e = 0; e < D; ++e) dot += qs[e] * kns[e];
        } else if (dense) {
            const T* kr = kb + (int64_t)j * k_strides[2];
            #pragma unroll
            for (int e = 0; e < D; e += 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(kr + e);
                const T* kv = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int i = 0; i < 8; ++i) dot += qs[e + i] * static_cast<float>(kv[i]);
            }
        } else {
            const T* kr = kb + (int64_t)j * k_strides[2];
            for (int e = 0; e < D; ++e) dot += qs[e] * static_cast<float>(kr[e * k_strides[3]]);
        }
        s = dot;
    }
""" + attention_cuda.TILE + """    #pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] *= corr;
    const int n = min(THREADS, keys - j0);
    #pragma unroll 4
    for (int i = warp; i < n; i += WARPS) {
        const float pi = ps[i];
        const int jj = j0 + i;
        if (pi != 0.0f && jj == at) {
            #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += pi * vns[lane * VEC + e];
        } else if (pi != 0.0f) {
""" + attention_cuda.ADD_VALUES + """        }
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
    if (h % group == 0 && split == 0) {
        kb[(int64_t)at * k_strides[2] + t * k_strides[3]] = kn[t * k_new_strides[3]];
        vb[(int64_t)at * v_strides[2] + t * v_strides[3]] = vn[t * v_new_strides[3]];
    }
}
"""

_BODY = compact(_SOURCE)


def cached_enabled() -> bool:
    """Whether one-token steps over a batch cache take :func:`attend_cached`: on CUDA with
    ``GMLX_CACHE_ATTENTION`` not ``0`` (on by default since the whole step it makes
    possible measured faster served, 12-05)."""
    return os.environ.get("GMLX_CACHE_ATTENTION", "1") != "0" and cuda_source.available()


def supports_cached(q: Any, k_new: Any, v_new: Any, keys: Any, values: Any, mask: Any, length: int) -> bool:
    """Whether a one-token step's attention may take :func:`attend_cached`: what
    :func:`attention_cuda.supports` asks of the queries and the cache's arrays, the step's new keys and
    values one position each, and no mask but the batch's padding (none, or a boolean
    one over all ``length`` keys so far, the step's own included: a shorter one is a
    window the kernel would not apply)."""
    import mlx.core as mx

    if q.ndim != 4 or keys.ndim != 4 or q.shape[2] != 1:
        return False
    b, heads, _, d = q.shape
    shape = (b, keys.shape[1], 1, d)
    return (q.dtype in (mx.float16, mx.bfloat16) and d in attention_cuda.HEAD_DIMS and keys.shape[0] == b
            and keys.shape[3] == d and values.shape == keys.shape and heads % keys.shape[1] == 0
            and all(a.dtype == q.dtype for a in (k_new, v_new, keys, values))
            and k_new.shape == shape and v_new.shape == shape
            and (mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4
                                  and mask.shape == (b, 1, 1, length))))


@cache
def _kernel(dtype: Any, head_dim: int, scale: float, split: bool = False) -> Any:
    """The cached kernel whole (a head's keys in one block) or ``split`` (its share of
    them, for the combine kernel): two kernels per float type, head size and scale,
    whatever the cache's length."""
    head = attention_cuda.kernel_head(dtype, head_dim, scale) + (attention_cuda.FINISH_SPLIT if split else attention_cuda.FINISH_ONE)
    return build(f"gmlx_attend_cached_{cuda_type(dtype).strip('_')}_{head_dim}{'_split' if split else ''}", head,
                 _BODY, ["q", "k_new", "v_new", "k", "v", "padding", "position"],
                 outputs=("pacc", "pm", "pl") if split else ("out",), ensure_row_contiguous=False)


def attend_cached(q: Any, k_new: Any, v_new: Any, keys: Any, values: Any, padding: Any, position: Any,
                  scale: float) -> Any:
    """A one-token step's attention over a batch cache in one launch: ``k_new`` and
    ``v_new`` (``(B, Hkv, 1, D)``) written **in place** into the cache's ``keys`` and
    ``values`` (``(B, Hkv, capacity, D)``) at ``position`` (an ``int32`` array of one: the
    cache's write position, the same for every stream), and ``softmax(q k^T * scale) v``
    over each stream's keys from its ``padding`` (``(B,)``) to that position ->
    ``(B, 1, H * D)``, shaped for the output projection. Over a long cache the keys are
    split over several blocks a head (:func:`attention_cuda.splits`) and a second launch combines
    their shares.

    Where mlx-lm's cache takes four operations and a view each for the same (two slice
    updates, two views of the keys so far, the attention, its reshape): each operation
    handed to MLX costs the host several microseconds, and a one-stream step on a GPU is
    bound by the host. MLX does not see the write: the caller keeps the cache's arrays
    its own and the positions up to the write unchanged (:meth:`prompt_cache.
    _AlignedBatchKVCache.write_and_attend`)."""
    b, heads, _, d = q.shape
    return attention_cuda.in_blocks(lambda split: _kernel(q.dtype, d, float(scale), split),
                      [q, k_new, v_new, keys, values, padding, position], q, keys.shape[2], (b, 1, heads * d))


def compile_cached(model: Any) -> int:
    """Run :func:`attend_cached` once whole and once split (:func:`attention_cuda.splits`) for every
    distinct attention shape among ``model``'s layers that write in place (one_token's
    ``_in_place``), on empty arrays, so both kernels and the combine are compiled before
    the model reports ready: a cache reaches the split form only once it has grown past
    a few tiles, inside some later request. Returns how many shapes."""
    import mlx.core as mx

    shapes = set()
    for _, m in model.named_modules():
        if getattr(m, "_in_place", False) and all(hasattr(m, a) for a in ("n_heads", "n_kv_heads", "head_dim", "scale")):
            proj = m.o_proj
            dtype = proj.scales.dtype if "scales" in proj else proj.weight.dtype
            shapes.add((m.n_heads, m.n_kv_heads, m.head_dim, float(m.scale), dtype))
    for heads, kv_heads, d, scale, dtype in shapes:
        if dtype not in (mx.float16, mx.bfloat16) or d not in attention_cuda.HEAD_DIMS:
            continue
        outs = []
        for capacity in (2 * attention_cuda.THREADS, 4 * attention_cuda.THREADS):  # one block a head, then two
            q = mx.zeros((1, heads, 1, d), dtype)
            new = mx.zeros((1, kv_heads, 1, d), dtype)
            cache = [mx.zeros((1, kv_heads, capacity, d), dtype) for _ in range(2)]
            outs.append(attend_cached(q, new, new, *cache, mx.zeros((1,), mx.int32),
                                      mx.array([capacity // 2], dtype=mx.int32), scale))
        mx.eval(outs)
    return len(shapes)
