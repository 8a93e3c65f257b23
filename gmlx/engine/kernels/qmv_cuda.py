"""A decode-sized 4-bit matmul for CUDA: ``x @ dequantize(w).T`` for a few rows of ``x``.

MLX's CUDA quantized matmul reads the whole weight matrix once per row of ``x``, so a
decode step of a batch of 8 or 32 streams costs 8 or 32 weight reads, and batched
4-bit decoding is flat in the batch size. This kernel reads each weight once per step
whatever the rows: a block of four warps owns eight output features, each warp two;
the rows of ``x`` sit in shared memory a tile at a time, and each lane dequantizes
eight 4-bit weights from one 32-bit word (MLX's affine layout: the low nibble first,
a scale and a bias per ``group_size`` weights) and multiplies them into every row.

Only built where MLX runs on CUDA (``available``); Metal and the CPU never reach it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

MAX_ROWS = 32
ROWS_PER_BLOCK = 8  # output features a block owns (4 warps x 2)
THREADS = 128

_SOURCE = r"""
    constexpr int RPW = 2;                       // output features per warp
    const int M = x_shape[0];                    // rows of x (at most ROWS)
    constexpr int K8 = K / 8;                    // 32-bit words per weight row
    constexpr int GROUPS = K / G;
    __shared__ __align__(16) float xs[ROWS * KT];  // x's tile, as float: 32 KiB
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * (blockDim.x / 32) + warp) * RPW;
    float acc[ROWS][RPW];
    #pragma unroll
    for (int m = 0; m < ROWS; ++m) {
        #pragma unroll
        for (int r = 0; r < RPW; ++r) acc[m][r] = 0.0f;
    }
    for (int kt = 0; kt < K; kt += KT) {
        __syncthreads();
        for (int i = threadIdx.x; i < ROWS * KT; i += blockDim.x) {
            const int m = i / KT;
            const int k = i - m * KT;
            xs[i] = m < M ? static_cast<float>(x[(size_t)m * K + kt + k]) : 0.0f;
        }
        __syncthreads();
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int n = n0 + r;
            if (n >= N) break;
            const uint32_t* wrow = w + (size_t)n * K8 + kt / 8;
            const T* srow = scales + (size_t)n * GROUPS;
            const T* brow = biases + (size_t)n * GROUPS;
            #pragma unroll 4
            for (int j = lane; j < KT / 8; j += 32) {
                const uint32_t q = wrow[j];
                const int g = (kt + j * 8) / G;
                const float s = static_cast<float>(srow[g]);
                const float b = static_cast<float>(brow[g]);
                float wv[8];
                #pragma unroll
                for (int t = 0; t < 8; ++t) wv[t] = s * static_cast<float>((q >> (4 * t)) & 0xFu) + b;
                #pragma unroll
                for (int m = 0; m < ROWS; ++m) {
                    const float4* xr = reinterpret_cast<const float4*>(xs + m * KT + j * 8);
                    const float4 a = xr[0];
                    const float4 c = xr[1];
                    acc[m][r] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                               + wv[4] * c.x + wv[5] * c.y + wv[6] * c.z + wv[7] * c.w;
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int n = n0 + r;
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            float v = acc[m][r];
            #pragma unroll
            for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0 && n < N && m < M) out[(size_t)m * N + n] = static_cast<T>(v);
        }
    }
"""


def available() -> bool:
    """Whether MLX runs on CUDA here (the only place this kernel is built)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu and not mx.metal.is_available()


def supports(rows: int, k: int, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a product of this shape goes through the kernel."""
    return (bits == 4 and mode == "affine" and 1 <= rows <= MAX_ROWS and group_size in (32, 64, 128)
            and k % 256 == 0)


@cache
def _kernel() -> Any:
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name="gmlx_qmv4",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
    )


def row_bucket(rows: int) -> int:
    """Rows compiled for: the next power of two, so few variants compile."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


def qmv4(x: Any, w: Any, scales: Any, biases: Any, group_size: int) -> Any:
    """``x [..., K] @ dequantize(w [N, K/8], scales, biases).T`` -> ``[..., N]``, with at
    most ``MAX_ROWS`` rows in ``x``'s leading dimensions (``supports``)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    bucket = row_bucket(rows)
    tile = (32 * 1024) // (4 * bucket)  # x's tile in shared memory: 32 KiB of floats
    tile = max(256, min(k, tile - tile % 256))
    while k % tile:
        tile -= 256
    (out,) = _kernel()(
        inputs=[x2, w, scales, biases],
        template=[("T", x.dtype), ("ROWS", bucket), ("K", k), ("N", n), ("G", group_size),
                  ("KT", tile)],
        grid=(-(-n // ROWS_PER_BLOCK) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)
