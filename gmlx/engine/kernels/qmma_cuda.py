"""Decode-sized quantized matmuls on tensor cores (CUDA): ``x @ dequantize(w).T`` for up
to 64 rows of ``x``, each weight read once per product whatever the rows.

MLX's affine layout keeps, per group of ``G`` codes of a weight row, ``w = s * q + b``.
So a group's share of a dot product is ``s * sum(x * q) + b * sum(x)``: the codes
themselves (small integers, exact in bf16/fp16) go into a tensor-core product
(``mma.sync m16n8k16``, float32 accumulators) and the scale and bias are applied after,
per 32-code chunk, in float32. That is both faster than dequantizing every weight to a
float (one bit-operation makes two codes into a pair of half floats: ``MAGIC | q`` is
``OFF + q``, with ``OFF`` folded into the bias) and closer to the float32 product than
MLX's own kernels, which round the dequantized weight.

Roles in the tensor-core product: A (16 x 16) is 16 output features' codes, B (16 x 8)
is 8 rows of ``x``, C (16 x 8) their float32 sums. The order of ``k`` inside a chunk is
free (a dot product sums over it), so it is chosen for the loads: lane ``(g, t)`` of a
warp (``g = lane / 4``, ``t = lane % 4``) takes codes ``8t .. 8t+7`` of a 32-code chunk,
one contiguous run of bits (one 32-bit word at 4 bits), and pairs code ``j`` with code
``j + 4`` in each 32-bit register (``(v >> 4j) & 0x000F000F`` at 4 bits); its row of
``x`` is paired the same way (``__byte_perm`` of one 16-byte load).

A block of ``WARPS`` warps owns ``16 * FT`` output features and splits ``K`` between its
warps (``U`` consecutive chunks at a time, all loaded before any is used: a decode-sized
product is bound by memory latency); the warps' float32 sums meet in shared memory.
``RT`` tiles of 8 rows cover the rows of ``x`` (rows past the end read as zeros).

Only built where MLX runs on CUDA (sm_80 and later: ``mma.sync`` with bf16); Metal and
the CPU never reach it. ``tests/engine/kernels/test_qmma_cuda.py`` replays the lane
arithmetic in numpy here; ``benchmarks/gpu/kernel_check.py`` checks the kernel against
MLX's CPU product on the GPU machine, and the load-time tuner refuses it for any layer
where it disagrees.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from gmlx.engine.kernels.cuda_source import build, compact, cuda_type

MAX_ROWS = 64
BITS = (4, 6, 8)
GROUPS = (32, 64, 128)
MAX_SHARED_FLOATS = 7 * 8 * 128  # (WARPS - 1) * FT * RT * 128 floats of shared memory

_SOURCE = r"""
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr bool PAIRED = BF == 0 || BITS < 8;   // codes enter the product as OFF + q
    constexpr float OFF = !PAIRED ? 0.0f : (BF ? 128.0f : 1024.0f);
    constexpr unsigned MAGIC = BF ? 0x43004300u : 0x64006400u;
    const int K = w_shape[1] * 32 / BITS;
    int rows = 1;
    for (int i = 0; i + 1 < x_ndim; ++i) rows *= x_shape[i];
    const int N = w_shape[0];
    const int chunks = K / 32;
    const int words = chunks * BITS;          // 32-bit words per weight row
    const int groups = K / G;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int f0 = blockIdx.x * (16 * FT);
    const int first_bit = 8 * t * BITS;       // this lane's codes in a chunk
    const int wshift = first_bit % 32;

    const uint32_t* wp[FT][2];
    const S* sp[FT][2];
    const S* bp[FT][2];
    #pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int f = min(f0 + 16 * ft + 8 * h + g, N - 1);  // past the end: read, never write
            wp[ft][h] = w + (size_t)f * words + first_bit / 32;
            sp[ft][h] = scales + (size_t)f * groups;
            bp[ft][h] = biases + (size_t)f * groups;
        }
    }
    float acc[FT][RT][4];
    #pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
        #pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[ft][rt][e] = 0.0f;
        }
    }

    // Each warp takes U consecutive chunks at a time and loads all of them (codes, scales,
    // biases, x) before it computes: a decode-sized product is bound by memory latency,
    // so a warp keeps U loads of each kind in flight.
    for (int c0 = warp * U; c0 < chunks; c0 += WARPS * U) {
        unsigned long long win[U][FT][2];
        float sraw[U][FT][2], braw[U][FT][2];
        uint4 xv[U][RT];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = min(c0 + u, chunks - 1);  // past the end: loaded, never used
            const int grp = c * 32 / G;
            #pragma unroll
            for (int ft = 0; ft < FT; ++ft) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t* p = wp[ft][h] + c * BITS;
                    unsigned long long v = p[0];
                    if (BITS > 4) v |= (unsigned long long)p[1] << 32;
                    win[u][ft][h] = v;
                    sraw[u][ft][h] = static_cast<float>(sp[ft][h][grp]);
                    braw[u][ft][h] = static_cast<float>(bp[ft][h][grp]);
                }
            }
            #pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const int r = 8 * rt + g;
                xv[u][rt] = r < rows ? *reinterpret_cast<const uint4*>(x + (size_t)r * K + c * 32 + 8 * t)
                                     : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c0 + u >= chunks) break;
            // The codes of this lane's two features (g and g + 8 of each tile) as A registers.
            uint32_t a[FT][2][4];
            float sc[FT][2], of[FT][2];
            #pragma unroll
            for (int ft = 0; ft < FT; ++ft) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned long long v = win[u][ft][h] >> wshift;
                    uint32_t pair[4];
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const unsigned lo = (unsigned)(v >> (BITS * j)) & MASK;
                        const unsigned hi = (unsigned)(v >> (BITS * (j + 4))) & MASK;
                        if (PAIRED) {
                            pair[j] = MAGIC | lo | (hi << 16);
                        } else {  // 8-bit codes in bf16: exact, but not by the bit trick
                            const float flo = __uint_as_float(0x4B000000u | lo) - 8388608.0f;
                            const float fhi = __uint_as_float(0x4B000000u | hi) - 8388608.0f;
                            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair[j]) : "f"(fhi), "f"(flo));
                        }
                    }
                    a[ft][0][h] = pair[0];
                    a[ft][0][2 + h] = pair[1];
                    a[ft][1][h] = pair[2];
                    a[ft][1][2 + h] = pair[3];
                    sc[ft][h] = sraw[u][ft][h];
                    of[ft][h] = braw[u][ft][h] - OFF * sraw[u][ft][h];
                }
            }
            #pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                // This lane's 8 values of row 8 rt + g, paired as the codes are (j with j + 4).
                const uint4 v = xv[u][rt];
                const uint32_t b0 = __byte_perm(v.x, v.z, 0x5410);
                const uint32_t b1 = __byte_perm(v.x, v.z, 0x7632);
                const uint32_t b2 = __byte_perm(v.y, v.w, 0x5410);
                const uint32_t b3 = __byte_perm(v.y, v.w, 0x7632);
                const T* xe = reinterpret_cast<const T*>(&v);
                float xs = 0.0f;
                #pragma unroll
                for (int j = 0; j < 8; ++j) xs += static_cast<float>(xe[j]);
                xs += __shfl_xor_sync(0xffffffffu, xs, 1);
                xs += __shfl_xor_sync(0xffffffffu, xs, 2);      // the chunk's sum of row 8 rt + g
                const float xs0 = __shfl_sync(0xffffffffu, xs, 8 * t);      // row 8 rt + 2t
                const float xs1 = __shfl_sync(0xffffffffu, xs, 8 * t + 4);  // row 8 rt + 2t + 1
                #pragma unroll
                for (int ft = 0; ft < FT; ++ft) {
                    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
                    if (BF) {
                        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                            : "r"(a[ft][0][0]), "r"(a[ft][0][1]), "r"(a[ft][0][2]), "r"(a[ft][0][3]),
                              "r"(b0), "r"(b1));
                        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                            : "r"(a[ft][1][0]), "r"(a[ft][1][1]), "r"(a[ft][1][2]), "r"(a[ft][1][3]),
                              "r"(b2), "r"(b3));
                    } else {
                        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                            : "r"(a[ft][0][0]), "r"(a[ft][0][1]), "r"(a[ft][0][2]), "r"(a[ft][0][3]),
                              "r"(b0), "r"(b1));
                        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                            : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                            : "r"(a[ft][1][0]), "r"(a[ft][1][1]), "r"(a[ft][1][2]), "r"(a[ft][1][3]),
                              "r"(b2), "r"(b3));
                    }
                    // d0, d1: feature g, rows 2t and 2t + 1; d2, d3: feature g + 8
                    acc[ft][rt][0] += sc[ft][0] * d0 + of[ft][0] * xs0;
                    acc[ft][rt][1] += sc[ft][0] * d1 + of[ft][0] * xs1;
                    acc[ft][rt][2] += sc[ft][1] * d2 + of[ft][1] * xs0;
                    acc[ft][rt][3] += sc[ft][1] * d3 + of[ft][1] * xs1;
                }
            }
        }
    }

    if (WARPS > 1) {
        __shared__ float partial[(WARPS > 1 ? WARPS - 1 : 1) * FT * RT * 4 * 32];
        if (warp > 0) {
            #pragma unroll
            for (int ft = 0; ft < FT; ++ft) {
                #pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        partial[((((warp - 1) * FT + ft) * RT + rt) * 4 + e) * 32 + lane] = acc[ft][rt][e];
                }
            }
        }
        __syncthreads();
        if (warp > 0) return;
        for (int k = 0; k < WARPS - 1; ++k) {
            #pragma unroll
            for (int ft = 0; ft < FT; ++ft) {
                #pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[ft][rt][e] += partial[(((k * FT + ft) * RT + rt) * 4 + e) * 32 + lane];
                }
            }
        }
    }
    #pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
        #pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int f = f0 + 16 * ft + g + 8 * (e >> 1);
                const int r = 8 * rt + 2 * t + (e & 1);
                if (f < N && r < rows) out[(size_t)r * N + f] = static_cast<T>(acc[ft][rt][e]);
            }
        }
    }
"""


_BODY = compact(_SOURCE)


def supports(rows: int, k: int, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a product of this shape may take the kernel (the tuner still measures)."""
    return (mode == "affine" and bits in BITS and group_size in GROUPS and 1 <= rows <= MAX_ROWS
            and k % group_size == 0 and k % 32 == 0)


def row_tiles(rows: int) -> int:
    """8-row tiles compiled for: 1, 2, 4 or 8 (so few variants compile)."""
    tiles = 1
    while tiles * 8 < rows:
        tiles *= 2
    return tiles


def default_config(rows: int) -> tuple[int, int, int]:
    """(feature tiles of 16 per block, warps per block, chunks in flight per warp)."""
    tiles = row_tiles(rows)
    return (1, 8, 8 if tiles == 1 else (4 if tiles == 2 else 2))


def configs(rows: int) -> list[tuple[int, int, int]]:
    """The launch shapes the load-time tuner times (the default first): each is one
    more kernel to compile at load, so two per row-tile count."""
    tiles = row_tiles(rows)
    other = (1, 4, 4) if tiles <= 2 else (1, 4, 2)
    return [c for c in dict.fromkeys([default_config(rows), other]) if fits(rows, c)]


def fits(rows: int, config: tuple[int, ...]) -> bool:
    """Whether a launch shape's cross-warp sums fit the shared memory allowed."""
    ft, warps = config[0], config[1]
    return (warps - 1) * ft * row_tiles(rows) * 128 <= MAX_SHARED_FLOATS


@cache
def _kernel(dtype: Any, scale_dtype: Any, tiles: int, bits: int, group_size: int, ft: int, warps: int,
            unroll: int) -> Any:
    """One kernel per layout, row tiles and launch shape (:mod:`cuda_source` says why)."""
    import mlx.core as mx

    t, s = cuda_type(dtype), cuda_type(scale_dtype)
    head = (f"using T = {t}; using S = {s}; constexpr int RT = {tiles}; constexpr int BITS = {bits}; "
            f"constexpr int G = {group_size}; constexpr int FT = {ft}; constexpr int WARPS = {warps}; "
            f"constexpr int U = {unroll}; constexpr int BF = {int(dtype == mx.bfloat16)};\n")
    return build(f"gmlx_qmma_{t.strip('_')}_{s.strip('_')}_{tiles}_{bits}_{group_size}_{ft}_{warps}_{unroll}",
                 head, _BODY, ["x", "w", "scales", "biases"])


def bound(w: Any, scales: Any, biases: Any, group_size: int, bits: int,
          config: tuple[int, ...] | None = None) -> Callable[[Any], Any]:
    """``qmm`` of this layer's weights as a function of ``x`` alone, its launch worked
    out once per row-tile count (a layer calls it on every decode step)."""
    n = w.shape[0]
    k = w.shape[1] * 32 // bits
    weights = [w, scales, biases]
    launches: dict[int, tuple[Any, tuple[int, int, int], tuple[int, int, int]]] = {}

    def run(x: Any) -> Any:
        rows = x.size // k
        tiles = row_tiles(rows)
        launch = launches.get(tiles)
        if launch is None:
            ft, warps, unroll = config or default_config(rows)
            kernel = _kernel(x.dtype, scales.dtype, tiles, bits, group_size, ft, warps, unroll)
            launch = launches[tiles] = (kernel, (-(-n // (16 * ft)) * 32 * warps, 1, 1), (32 * warps, 1, 1))
        kernel, grid, threadgroup = launch
        (out,) = kernel(inputs=[x, *weights], grid=grid, threadgroup=threadgroup,
                        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])
        return out

    return run


def qmm(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int,
        config: tuple[int, ...] | None = None) -> Any:
    """``x [..., K] @ dequantize(w [N, K*bits/32], scales, biases).T`` -> ``[..., N]``
    on tensor cores, for at most ``MAX_ROWS`` rows in ``x``'s leading dimensions
    (``x`` bf16 or fp16)."""
    return bound(w, scales, biases, group_size, bits, config)(x)
