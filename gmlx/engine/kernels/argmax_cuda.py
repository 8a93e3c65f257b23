"""A greedy decode step's argmax over the vocabulary, for CUDA: one block of 1,024 threads
a row, every thread's share of the row loaded 16 bytes at a time with eight loads in
flight, then the block's best (value, index) by shuffles and one warp.

Why: a greedy step without log-probabilities ends in ``mx.argmax`` over its logits
(``DecodeBatch._step``, :mod:`gmlx.engine.mlxlm`), and MLX's reduction took 23-25 us of
the 8B's one-stream step on the H100 (12-06: 128,256 float16 logits, 256 KB), about what
the 4096x4096 o-projection costs for 40 times the bytes. A block that has its whole
share of a 256 KB row in flight in two rounds needs a few microseconds.

The same index as ``mx.argmax`` for every row (:func:`argmax`'s check in the tests): the
first of the row's largest values, a NaN larger than any number (the first NaN where
there is one), index 0 for a row of ``-inf``. Used where it is built (CUDA) and not
turned off (``GMLX_ARGMAX_KERNEL=0``), routed to the decode steps by a load
(:func:`gmlx.engine.mlxlm.route_greedy`); elsewhere ``mx.argmax``. The tests run the source
on the CPU, each block as host threads, against ``mx.argmax``, and compile it for sm_90;
a load on CUDA checks it against ``mx.argmax`` before greedy steps take it (:func:`check`).
Not yet timed in a GPU's step (12-07: the lease's trace loops called ``mx.argmax``
themselves; they take the decode step's route now, ``mlxlm.greedy_argmax``)."""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from gmlx.engine.kernels import cuda_source
from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

ENV = "GMLX_ARGMAX_KERNEL"
THREADS = 1024
IN_FLIGHT = 8  # 16-byte loads a thread has in flight: a 128,256-wide float16 row in two rounds
_agrees: bool | None = None  # the load's check (:func:`check`), once a process; None: not yet

# ``better(v, i, w, j)``: whether value ``v`` at ``i`` goes before ``w`` at ``j`` as
# mx.argmax orders them (a NaN above every number, then the larger value, then the lower
# index; ``j`` UINT32_MAX: nothing yet)
_SOURCE = """
constexpr int WARPS = THREADS / 32;
constexpr int VPT = 16 / sizeof(T);
__shared__ float wv[WARPS];
__shared__ uint32_t wi[WARPS];
const int t = threadIdx.x;
const int lane = t & 31;
const int warp = t >> 5;
const int n = logits_shape[1];
const T* x = logits + (size_t)blockIdx.x * n;
auto better = [](float v, uint32_t i, float w, uint32_t j) -> bool {
    const bool vn = v != v, wn = w != w;
    if (j == 0xffffffffu) return true;
    if (vn || wn) return vn && (!wn || i < j);
    return v > w || (v == w && i < j);
};
float best = 0.0f;
uint32_t at = 0xffffffffu;
const bool wide = n % VPT == 0 && (reinterpret_cast<unsigned long long>(x) & 15) == 0;
if (wide) {
    const int vecs = n / VPT;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int base = t; base < vecs; base += THREADS * IN_FLIGHT) {
        uint4 raw[IN_FLIGHT];
        #pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
            const int i = base + u * THREADS;
            if (i < vecs) raw[u] = xv[i];
        }
        #pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
            const int i = base + u * THREADS;
            if (i >= vecs) break;
            const T* e = reinterpret_cast<const T*>(&raw[u]);
            #pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const float v = static_cast<float>(e[k]);
                const uint32_t j = (uint32_t)(i * VPT + k);
                if (better(v, j, best, at)) { best = v; at = j; }
            }
        }
    }
} else {
    for (int i = t; i < n; i += THREADS) {
        const float v = static_cast<float>(x[i]);
        if (better(v, (uint32_t)i, best, at)) { best = v; at = (uint32_t)i; }
    }
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const uint32_t j = __shfl_xor_sync(0xffffffffu, at, o);
    if (j != 0xffffffffu && better(v, j, best, at)) { best = v; at = j; }
}
if (lane == 0) { wv[warp] = best; wi[warp] = at; }
__syncthreads();
if (warp == 0) {
    best = lane < WARPS ? wv[lane] : 0.0f;
    at = lane < WARPS ? wi[lane] : 0xffffffffu;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const uint32_t j = __shfl_xor_sync(0xffffffffu, at, o);
        if (j != 0xffffffffu && better(v, j, best, at)) { best = v; at = j; }
    }
    if (lane == 0) out[blockIdx.x] = at == 0xffffffffu ? 0u : at;
}
"""


@cache
def _on_cuda() -> bool:
    return cuda_source.available()


def enabled() -> bool:
    """Whether greedy decode steps take :func:`argmax`: on CUDA unless ``GMLX_ARGMAX_KERNEL=0``
    (asked every step: the device, once a process)."""
    return os.environ.get(ENV, "1") != "0" and _on_cuda()


@cache
def _kernel(dtype: Any) -> Any:
    head = f"using T = {cuda_type(dtype)};\nconstexpr int THREADS = {THREADS}; constexpr int IN_FLIGHT = {IN_FLIGHT};\n"
    return build(f"gmlx_argmax_{cuda_type(dtype).strip('_')}", head, compact(_SOURCE), ["logits"])


def supports(logits: Any) -> bool:
    """Whether :func:`argmax` takes ``logits``: rows of a floating type, ``(rows, n)``."""
    import mlx.core as mx

    return (logits.ndim == 2 and logits.dtype in (mx.float16, mx.bfloat16, mx.float32)
            and 0 < logits.shape[1] < 2**31 - 1 and logits.shape[0] > 0)


def argmax(logits: Any) -> Any:
    """``mx.argmax(logits, axis=-1)`` (``uint32``, one index a row) in one launch a step."""
    import mlx.core as mx

    rows = logits.shape[0]
    return _kernel(logits.dtype)(inputs=[logits], output_shapes=[(rows,)], output_dtypes=[mx.uint32],
                                 grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1))[0]


def check() -> str | None:
    """Once a process, at a model's load where :func:`enabled`: the kernel against
    ``mx.argmax`` on rows of each floating type (a vocabulary's width in wide loads with
    its maximum three times, a width not a multiple of one); greedy steps take it only
    where every row agreed. A kernel that does not compile or launch here, or disagrees,
    leaves them ``mx.argmax`` and the load goes on. Returns the load's log line (None
    where nothing was checked)."""
    import mlx.core as mx

    global _agrees
    if _agrees is not None or not enabled():
        return None
    try:
        for dtype in (mx.float16, mx.bfloat16, mx.float32):
            for n in (128256, 1001):
                x = mx.random.normal((3, n), key=mx.random.key(n)).astype(dtype)
                x[0, n // 2] = x[0, n - 1] = x[0, 7] = 100.0
                mx.eval(x)
                if argmax(x).tolist() != mx.argmax(x, axis=-1).tolist():
                    raise RuntimeError(f"it disagrees with mx.argmax ({dtype}, rows of {n})")
    except RuntimeError as error:
        _agrees = False
        return f"cuda: a greedy step's argmax stays MLX's: {str(error).splitlines()[0][:200]}"
    _agrees = True
    return "cuda: a greedy step's argmax in one launch a row"


def agrees() -> bool:
    """Whether greedy steps may take :func:`argmax`: on, and agreed at the load's :func:`check`."""
    return bool(_agrees) and enabled()


def greedy(logits: Any) -> Any:
    """A greedy step's tokens: :func:`argmax` where it is on, agreed at the load's
    :func:`check` and takes ``logits``, else ``mx.argmax`` (mlx-lm's ``greedy_sampler``)."""
    import mlx.core as mx

    if agrees() and supports(logits):
        return argmax(logits)
    return mx.argmax(logits, axis=-1)
