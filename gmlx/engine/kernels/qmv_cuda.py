"""Decode-sized quantized matmuls for CUDA: ``x @ dequantize(w).T`` for a few rows of ``x``.

MLX's CUDA quantized matmul reads the weight matrix once per row of ``x`` at decode
sizes, so a step of a batch of 8 or 32 streams costs many weight reads and batched
quantized decoding is nearly flat in the batch size. Two paths replace it where they
measure faster (``fast_linear`` decides per layer shape and row count, at load):

- ``qmv``: a kernel that reads each weight once per step whatever the rows. A block of
  ``WARPS`` warps owns ``NR`` output features and splits their row of weights between its
  warps; each lane takes one *pack* at a time (8 codes in one 32-bit word at 4 bits, 8 in
  two words at 8 bits, 16 in three words at 6 bits: MLX's affine layout is a little-endian
  bit stream), dequantizes it once into registers (``scale * code + bias``, the pack lies
  in one group) and multiplies it into every row of ``x``, read straight from global
  memory (L1 serves the rows to the block's warps). Partial sums meet in a warp shuffle,
  then across the warps in shared memory.
- ``dequantized``: MLX's own dequantize then a dense matmul: at 16-32 rows the dense
  product (tensor cores) beats re-reading the quantized weights per row, even though the
  float weights are written and read once per step.

Only built where MLX runs on CUDA (``available``); Metal and the CPU never reach it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

MAX_ROWS = 32  # rows a decode step's product may have for these paths (larger: MLX's)
KERNEL_ROWS = (1, 2, 4, 8, 16)  # row buckets the kernel compiles for
BITS = (4, 6, 8)
GROUPS = (32, 64, 128)

_SOURCE = r"""
    constexpr int P = BITS == 6 ? 16 : 8;           // codes per pack
    constexpr int W = P * BITS / 32;                // 32-bit words per pack
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int XV = P * (int)sizeof(T) / 16;     // 16-byte loads per pack of x
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int packs = K / P;
    const int words = K / 32 * BITS;
    const int groups = K / G;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n0 = blockIdx.x * NR;

    const uint32_t* wrow[NR];
    const S* srow[NR];
    const S* brow[NR];
    #pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int n = min(n0 + r, N - 1);  // past the end: read a real row, write nothing
        wrow[r] = w + (size_t)n * words;
        srow[r] = scales + (size_t)n * groups;
        brow[r] = biases + (size_t)n * groups;
    }
    float acc[M][NR];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < NR; ++r) acc[m][r] = 0.0f;
    }

    #pragma unroll 2
    for (int p = warp * 32 + lane; p < packs; p += 32 * WARPS) {
        const int g = p * P / G;
        float wv[NR][P];
        #pragma unroll
        for (int r = 0; r < NR; ++r) {
            uint32_t q[W];
            #pragma unroll
            for (int i = 0; i < W; ++i) q[i] = wrow[r][p * W + i];
            const float s = static_cast<float>(srow[r][g]);
            const float b = static_cast<float>(brow[r][g]);
            #pragma unroll
            for (int t = 0; t < P; ++t) {
                const int bit = t * BITS;
                const int word = bit / 32;
                const int sh = bit % 32;
                unsigned v = q[word] >> sh;
                if (sh + BITS > 32) v |= q[word + 1] << (32 - sh);
                v &= MASK;
                // the code as a float without a conversion instruction: 2^23 + v, less 2^23
                wv[r][t] = fmaf(s, __uint_as_float(0x4B000000u | v) - 8388608.0f, b);
            }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m < rows) {
                uint4 raw[XV];
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + (size_t)p * P);
                #pragma unroll
                for (int i = 0; i < XV; ++i) raw[i] = xp[i];
                const T* xe = reinterpret_cast<const T*>(raw);
                #pragma unroll
                for (int t = 0; t < P; ++t) {
                    const float xv = static_cast<float>(xe[t]);
                    #pragma unroll
                    for (int r = 0; r < NR; ++r) acc[m][r] = fmaf(wv[r][t], xv, acc[m][r]);
                }
            }
        }
    }

    __shared__ float partial[WARPS * M * NR];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < NR; ++r) {
            float v = acc[m][r];
            #pragma unroll
            for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) partial[(warp * M + m) * NR + r] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < M * NR; i += blockDim.x) {
        const int m = i / NR;
        const int n = n0 + i % NR;
        float v = 0.0f;
        #pragma unroll
        for (int k = 0; k < WARPS; ++k) v += partial[k * M * NR + i];
        if (m < rows && n < N) out[(size_t)m * N + n] = static_cast<T>(v);
    }
"""


def available() -> bool:
    """Whether MLX runs on CUDA here (the only place this kernel is built)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu and not mx.metal.is_available()


def supports(rows: int, k: int, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a product of this shape may take one of these paths (``fast_linear``
    still measures which, if any, wins)."""
    return (mode == "affine" and bits in BITS and group_size in GROUPS and 1 <= rows <= MAX_ROWS
            and k % group_size == 0 and k % 16 == 0)


def row_bucket(rows: int) -> int:
    """Rows compiled for: the next power of two, so few variants compile."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


def layout(bits: int) -> tuple[int, int]:
    """(codes, 32-bit words) of one pack, as the kernel reads them."""
    codes = 16 if bits == 6 else 8
    return codes, codes * bits // 32


def default_config(bucket: int) -> tuple[int, int]:
    """(output features per block, warps per block) for a row bucket: fewer features per
    block as the rows grow, so a lane's accumulators (rows x features) stay in registers."""
    return (4, 4) if bucket <= 8 else (2, 4)


def configs(rows: int) -> list[tuple[int, int]]:
    """The launch shapes the load-time tuner times for a row bucket (the default first):
    two per bucket, the runners-up of the H200 check (kernel_check.py, six shapes each),
    because every shape is one more kernel to compile at load (seconds each there). A
    lane keeps rows x features accumulators, at most 64."""
    bucket = row_bucket(rows)
    other = {1: (8, 4), 2: (8, 4), 4: (8, 4), 8: (8, 2), 16: (4, 2)}.get(bucket, (2, 4))
    tried = list(dict.fromkeys([default_config(bucket), other]))
    return [(nr, warps) for nr, warps in tried if bucket * nr <= 64]


@cache
def _kernel() -> Any:
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name="gmlx_qmv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
    )


def qmv(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int,
        config: tuple[int, int] | None = None) -> Any:
    """``x [..., K] @ dequantize(w [N, K*bits/32], scales, biases).T`` -> ``[..., N]``
    through the kernel, for at most ``KERNEL_ROWS[-1]`` rows in ``x``'s leading
    dimensions."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    bucket = row_bucket(rows)
    nr, warps = config or default_config(bucket)
    (out,) = _kernel()(
        inputs=[x2, w, scales, biases],
        template=[("T", x.dtype), ("S", scales.dtype), ("M", bucket), ("BITS", bits),
                  ("G", group_size), ("NR", nr), ("WARPS", warps)],
        grid=(-(-n // nr) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)


def dequantized(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int) -> Any:
    """The same product through MLX's dequantize and a dense matmul."""
    import mlx.core as mx

    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    return x @ dense.astype(x.dtype).T
