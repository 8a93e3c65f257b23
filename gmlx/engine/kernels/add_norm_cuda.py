"""A residual add and the RMSNorm after it in one CUDA kernel, for decode steps.

A llama-pattern block (llama, mistral's models through it, qwen2, qwen3, phi3) ends its
attention with ``h = x + attention(...)`` and normalizes ``h`` for its MLP, and ends with
``h + mlp(...)``, which the next block (or the model's final norm) normalizes first: two
MLX operations each time, four a layer, in a decode step bound by the host (on the H200
an MLX add costs the host ~9 us a call, a custom kernel ~4.5: ``call_cost.py``). Here
each pair is one kernel with two outputs, the sum ``h`` (rounded to the activations'
type, as MLX's add rounds it) and ``rms_norm(h) * weight``: two operations a layer.

The block's second sum is still built (``out = h + r``, what the model's loop passes
on) but the next block, or the final norm, takes the sum's two parts instead when what it
is handed is that very array (a thread-local note of the last block's output), so MLX
never evaluates the add: nothing reads it. Anything else between the blocks (a model
that scales or mixes the hidden state) hands over another array and meets the plain path.

The kernel: one block of 256 threads per row; each thread loads its elements of both
inputs and of the weight first (into registers), adds them in float32, rounds the sum to
the activations' type and keeps its square, the block sums the squares (shuffles, then
one warp), and each thread writes its elements times ``rsqrt(mean + eps)`` times the
weight, rounded. Only built on CUDA; only for one-token steps (``L =
1``); only for the layer classes in :data:`FAMILIES` and ``nn.RMSNorm`` norms. Off unless
``GMLX_ADD_NORM_KERNEL=1`` until it is measured on a GPU
(``benchmarks/gpu/pipeline_check.py``'s ``add norm`` loop). The tests run the kernel's
own source on the CPU with CUDA's block primitives emulated, and the wiring with MLX's
own add and norm standing in for the kernel (the same logits, bit for bit).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

from mlx import nn

from gmlx.engine.kernels import cuda_source, swaps
from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

ENV = "GMLX_ADD_NORM_KERNEL"
THREADS = 256
MAX_WIDTH = 8192  # 32 values of each kind a thread, in registers; wider rows keep MLX's
FAMILIES = ("llama", "qwen2", "qwen3", "phi3")  # their TransformerBlock is the pattern above

# Every load (x, r and the weight) is issued before any store: MLX hands a custom kernel
# plain pointers, which the compiler must assume may alias the outputs, so a load after a
# store waits for it (the first form, loading and storing element by element, took ~11 us
# more a call on the H200 than MLX's add and norm: a memory round trip per element).
_SOURCE = """
constexpr int PER = (D + THREADS - 1) / THREADS;
__shared__ float red[THREADS / 32];
const int t = threadIdx.x;
const int lane = t & 31;
const int warp = t >> 5;
const size_t base = (size_t)blockIdx.x * D;
float hv[PER], wv[PER];
#pragma unroll
for (int j = 0; j < PER; ++j) {
    const int i = t + j * THREADS;
    hv[j] = 0.0f;
    wv[j] = 0.0f;
    if (i < D) {
        hv[j] = static_cast<float>(static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(r[base + i])));
        wv[j] = static_cast<float>(w[i]);
    }
}
float ss = 0.0f;
#pragma unroll
for (int j = 0; j < PER; ++j) {
    const int i = t + j * THREADS;
    if (i < D) h[base + i] = static_cast<T>(hv[j]);
    ss += hv[j] * hv[j];
}
for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
if (lane == 0) red[warp] = ss;
__syncthreads();
if (warp == 0) {
    float v = lane < THREADS / 32 ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[0] = v;
}
__syncthreads();
const float inv = rsqrtf(red[0] / D + EPS);
#pragma unroll
for (int j = 0; j < PER; ++j) {
    const int i = t + j * THREADS;
    if (i < D) out[base + i] = static_cast<T>(static_cast<float>(static_cast<T>(hv[j] * inv)) * wv[j]);
}
"""
_BODY = compact(_SOURCE)
_pending = threading.local()  # the last block's output on this thread, and its two parts


def enabled() -> bool:
    """Whether ``GMLX_ADD_NORM_KERNEL=1`` and MLX runs on CUDA here."""
    return os.environ.get(ENV, "0") == "1" and cuda_source.available()


@cache
def _kernel(dtype: Any, d: int, eps: float) -> Any:
    """One kernel per float type, width and epsilon (:mod:`cuda_source` says why)."""
    head = (f"using T = {cuda_type(dtype)}; constexpr int D = {d}; constexpr int THREADS = {THREADS}; "
            f"constexpr float EPS = {float(eps)!r}f;\n")
    return build(f"gmlx_add_norm_{d}", head, _BODY, ["x", "r", "w"], outputs=("h", "out"))


def add_norm(x: Any, r: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """``(x + r, rms_norm(x + r) * weight)`` in one kernel (``x`` and ``r`` of one shape,
    fp16 or bf16, the last axis normalized)."""
    d = x.shape[-1]
    h, out = _kernel(x.dtype, d, eps)(
        inputs=[x, r, weight], grid=(THREADS * (x.size // d), 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, out


def mlx_add_norm(x: Any, r: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """What :func:`add_norm` computes, in MLX's own operations (the model's own code)."""
    import mlx.core as mx

    h = x + r
    return h, mx.fast.rms_norm(h, weight, eps)


def supports(x: Any, weight: Any) -> bool:
    """Whether a one-token step's hidden state may take the kernel."""
    import mlx.core as mx

    return (x.ndim == 3 and x.shape[1] == 1 and x.dtype in (mx.float16, mx.bfloat16)
            and x.shape[-1] <= MAX_WIDTH and weight.dtype == x.dtype and weight.shape == (x.shape[-1],))


def hand_on(h: Any, r: Any) -> Any:
    """A fused block's output, built from its two parts, noted for the next block."""
    out = _hand_on(h, r)
    _pending.note = (out, h, r)
    return out


def _hand_on(h: Any, r: Any) -> Any:
    """The block's output as the model's loop expects it: built for whoever reads it,
    while the next block (or the final norm) takes ``h`` and ``r`` instead."""
    return h + r


def take(x: Any) -> tuple[Any, Any] | None:
    """The two parts of ``x`` when it is the last fused block's output on this thread
    (the note is used up either way)."""
    note = getattr(_pending, "note", None)
    _pending.note = None
    if note is not None and note[0] is x:
        return note[1], note[2]
    return None


def attach(model: Any, fused: Callable[..., tuple[Any, Any]] = add_norm) -> int:
    """Give ``model``'s llama-pattern blocks (and the norm after the last) the fused add
    and norm for one-token steps, ``fused`` computing it; returns the blocks changed."""
    blocks = _block_classes()
    changed = 0
    for _, module in model.named_modules():
        if type(module) in blocks and _plain_norms(module):
            module.__class__ = _fused_block(type(module))
            object.__setattr__(module, "_add_norm", fused)
            changed += 1
    if changed:
        for _, module in model.named_modules():
            norm = module.get("norm") if isinstance(module, dict) else None
            if type(norm) is nn.RMSNorm:
                norm.__class__ = _FusedFinalNorm
                object.__setattr__(norm, "_add_norm", fused)
    return changed


def detach(model: Any) -> None:
    """Give the blocks and the final norm their own classes back."""
    swaps.restore(model, "add_norm")


def _plain_norms(block: Any) -> bool:
    return all(type(block.get(name)) is nn.RMSNorm for name in ("input_layernorm", "post_attention_layernorm"))


@cache
def _block_classes() -> frozenset[type]:
    return swaps.family_classes(FAMILIES, "TransformerBlock")


@cache
def _fused_block(cls: type) -> type:
    """``cls`` whose one-token steps add and normalize in one kernel each time."""

    def __call__(self: Any, x: Any, mask: Any = None, cache: Any = None) -> Any:
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        parts = take(x)
        if not supports(x, norm1.weight):
            return cls.__call__(self, x, mask, cache)
        fused = self._add_norm
        if parts is None:
            h, n = x, norm1(x)
        else:
            h, n = fused(parts[0], parts[1], norm1.weight, norm1.eps)
        h, n = fused(h, self.self_attn(n, mask, cache), norm2.weight, norm2.eps)
        return hand_on(h, self.mlp(n))

    return swaps.subclass(cls, "add_norm", __call__)


class _FusedFinalNorm(nn.RMSNorm):
    """The model's norm after its last block: the fused add and norm when handed that
    block's output, RMSNorm otherwise."""

    add_norm = True
    _add_norm: Callable[..., tuple[Any, Any]]

    def __call__(self, x: Any) -> Any:
        parts = take(x)
        if parts is None or not supports(x, self.weight):
            return super().__call__(x)
        return self._add_norm(parts[0], parts[1], self.weight, self.eps)[1]
