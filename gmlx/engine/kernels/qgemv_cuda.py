"""Quantized products of one to eight rows on CUDA cores (a decode step of a few
streams): ``x [rows, K] @ dequantize(w).T`` for MLX's affine 4-, 6- and 8-bit layouts,
bound by reading the weights once at full width.

Why: at one row a decode step is the weights read once, and on the H200 MLX's own
product reads a Llama-3-8B's 4-bit group-32 layers at ~0.8 TB/s (a step's products
~6 ms of GPU time; the host's share of the step is ~3.5 ms), where llama.cpp's whole
step takes ~4 ms. A custom kernel costs MLX's host no more than its own product
(benchmarks/gpu/call_cost.py: 4.4 us a call against 6.3), so the GPU time is what to win.

Layout: a weight row is a little-endian bit stream of codes (code ``k`` at bit
``BITS * k``), a group of ``G`` codes shares a scale ``s`` and a bias ``b``: ``w = s * q +
b``. A 32-code chunk is 16 (4-bit), 24 (6-bit) or 32 (8-bit) bytes, loaded by one lane
in one to three wide loads, so a warp reads 512 to 1,024 contiguous bytes of a row at a
time. Lane ``l`` takes chunks ``l, l + 32, ...`` of each of its warp's ``RPW`` rows; its 32
values of ``x`` are read once per chunk (through L1: every warp reads the same ``x``),
made float, and serve all ``RPW`` rows. A chunk's share is ``s * sum(x q) + b * sum(x)``
in float32. A code becomes a float in one instruction and is used by one FMA: a 4- or
6-bit code as the float ``0.5 + q / 256`` (its byte permuted, or or-ed, under the
exponent of 0.5), so ``sum(x q) = 256 * (sum(x f) - sum(x) / 2)`` (the share then ``256
s * sum(x f) + (b - 128 s) * sum(x)``); an 8-bit code as ``2^23 + q``'s bit pattern minus
``2^23``. The first form took every code through ``2^23 + q`` and a subtract: one
instruction a code more, where 4-bit products were bound by their instructions. The
lanes' sums meet by shuffles. ``WARPS`` warps per block. At one row a lane may load
``DEPTH`` of its chunks (codes, scales, biases and ``x``) before using any: a product of an
8B's 4,096-wide layers is four chunks a lane, so with one in flight at a time most of a
warp's life is waiting on memory (the one-row kernel reached 1.4-1.7 TB/s of the H100's
3.35); the tuner times depth 2 beside depth 1.

With two to eight rows of ``x`` (a second source, ``MAXR`` rows at most, the row count
read from ``x``'s shape) each chunk's codes of every weight row of the warp are made
floats once, and each row of ``x``'s 32 values loaded, made float and summed once, then
taken against every weight row: the same sums per (weight row, row of ``x``) as one
row's; lane 0 writes them. (Its first form loaded and converted ``x`` again for each
weight row: about 32 instructions a code at 8 rows, where this is about half.) New and not yet timed on a GPU: the tuner times it at the 2-, 4- and 8-row
buckets beside MLX's product and the tensor-core kernel, and keeps whichever is fastest.

At one row a launch shape may also stage x in the block's shared memory first (its
fifth number, the row tiles a block takes; :data:`STAGED`), so a lane's loads in flight
are the weights' alone (see ``_STAGED_SOURCE``); with ``GMLX_STAGED=1`` the load times
those shapes beside the others.

Gated (``bound(..., up=...)``, :mod:`glu_cuda`): both sources also compute an MLP's
``silu(x @ gate.T) * (x @ up.T)`` in one kernel, a warp taking half its rows from each
layer's weights (the same rows of both) and writing the swiglu of each pair.

Only built where MLX runs on CUDA; Metal and the CPU never reach it. The tests replay
its indexing and arithmetic in numpy against MLX's CPU product, and run both sources
themselves on the CPU with CUDA's shuffles and bit instructions emulated
(``tests/engine/kernels/test_qgemv_cuda.py``); ``benchmarks/gpu/gemv_check.py`` checks
the kernel itself against MLX's CPU product on the GPU machine, and the load-time tuner
(``fast_linear``) refuses it for any layer where it disagrees.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

from gmlx.engine.kernels.cuda_source import SWIGLU, build, compact, cuda_type, layer_names

BITS = (4, 6, 8)
GROUPS = (32, 64, 128)
MAX_ROWS = 8  # rows of x the few-rows source takes (a bucket of at most 8 streams)

# Every source's start: the layout's sizes, this lane's place; then (``_START``) this
# warp's weight rows.
_LAYOUT = r"""
    constexpr unsigned MASK = (1u << BITS) - 1u;
    // a chunk's share from its codes' sum against x (dot) and x's sum (xs): codes of 4 and
    // 6 bits are the floats 0.5 + q / 256 (one byte permute or one or, no subtract), so
    // sum(x q) = 256 (dot - xs / 2); 8-bit codes are the floats q (2^23 + q minus 2^23)
    #define CHUNK(s, b, dot, xs) (BITS == 8 ? (s) * (dot) + (b) * (xs) : (256.0f * (s)) * (dot) + ((b) - 128.0f * (s)) * (xs))
    const int K = w_shape[1] * 32 / BITS;
    const int N = ROWS_TOTAL;
    const int words = K / 32 * BITS;      // 32-bit words per weight row
    const int chunks = K / 32;
    const int groups = K / G;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
"""
_START = _LAYOUT + r"""
    const int n0 = (blockIdx.x * WARPS + warp) * OUTS;
    if (n0 >= N) return;
"""

# A chunk's codes, scale and bias of each of a warp's weight rows into ``q``, ``s``, ``b``
# (declared by the source: the one-row source's are references into its DEPTH chunks'
# arrays): every load issued before any use.
_ROW_LOADS = r"""
        const int grp = c * 32 / G;
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int n = min(n0 + r % OUTS, N - 1);  // past the end: read, never written
            const uint32_t* p = ROW_W(r, n) + (size_t)c * BITS;
            if (BITS == 4) {
                const uint4 u = *reinterpret_cast<const uint4*>(p);
                q[r][0] = u.x; q[r][1] = u.y; q[r][2] = u.z; q[r][3] = u.w;
            } else if (BITS == 8) {
                const uint4 u0 = reinterpret_cast<const uint4*>(p)[0];
                const uint4 u1 = reinterpret_cast<const uint4*>(p)[1];
                q[r][0] = u0.x; q[r][1] = u0.y; q[r][2] = u0.z; q[r][3] = u0.w;
                q[r][4] = u1.x; q[r][5] = u1.y; q[r][6] = u1.z; q[r][7] = u1.w;
            } else {
                #pragma unroll
                for (int v = 0; v < BITS / 2; ++v) {
                    const uint2 u = reinterpret_cast<const uint2*>(p)[v];
                    q[r][2 * v] = u.x; q[r][2 * v + 1] = u.y;
                }
            }
            s[r] = static_cast<float>(ROW_S(r, n)[grp]);
            b[r] = static_cast<float>(ROW_B(r, n)[grp]);
        }
"""
_LOAD_ROWS = """
        uint32_t q[RPW][BITS];
        float s[RPW], b[RPW];""" + _ROW_LOADS
# This lane's 32 values of x (four wide words, XRAW[0..3]) as floats, and their sum
# (``xf``, ``xs``).
_X_FLOATS = r"""
        float xf[32];
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
            const T* e = reinterpret_cast<const T*>(&XRAW[v]);
            #pragma unroll
            for (int j = 0; j < 8; ++j) xf[8 * v + j] = static_cast<float>(e[j]);
        }
        float xs = 0.0f;
        #pragma unroll
        for (int j = 0; j < 32; ++j) xs += xf[j];
"""
# This lane's 32 values of x (of the row at XROW) in four wide loads, as ``_X_FLOATS``.
_LOAD_X = r"""
        uint4 xr[4];
        const uint4* xp = reinterpret_cast<const uint4*>(XROW + (size_t)c * 32);
        #pragma unroll
        for (int v = 0; v < 4; ++v) xr[v] = xp[v];
""" + _X_FLOATS.replace("XRAW", "xr")

# Code ``j`` of row ``r``'s chunk (``q[r]``) as the float ``f`` the sums take: 4-bit, a
# word's even or odd codes masked into bytes, then one byte permute under 0.5's exponent
# (``0.5 + q / 256``); 8-bit, the permute alone into ``2^23 + q``, less ``2^23``; 6-bit, its
# bit window (across two words through a funnel shift) or-ed under 0.5's exponent. (The
# 4-bit masks are the same for the four codes of a word half: the unrolled loop computes
# each once.)
_CODE = r"""
                unsigned bits;
                if (BITS == 4) {
                    const uint32_t src = ((j & 1) ? (q[r][j / 8] >> 4) : q[r][j / 8]) & 0x0F0F0F0Fu;
                    bits = __byte_perm(src, 0x3F000000u, 0x7054 | (((j % 8) >> 1) << 8));
                } else if (BITS == 8) {
                    bits = __byte_perm(q[r][j / 4], 0x4B000000u, 0x7540 | (j & 3));
                } else {
                    const int bit = BITS * j;
                    const int wi = bit / 32;
                    const int off = bit % 32;
                    const unsigned code = off + BITS <= 32 ? (q[r][wi] >> off) & MASK
                                                           : __funnelshift_r(q[r][wi], q[r][wi + 1], off) & MASK;
                    bits = 0x3F000000u | (code << 16);
                }
                const float f = BITS == 8 ? __uint_as_float(bits) - 8388608.0f : __uint_as_float(bits);
"""

# The DEPTH chunks' codes, scales and biases of a lane's rows (``_ROW_LOADS`` into the
# depth's arrays), every load issued before any use.
_DEPTH_LOADS = r"""        #pragma unroll
        for (int di = 0; di < DEPTH; ++di) {
            const int c = c0 + 32 * di;
            if (c < chunks) {
                uint32_t (&q)[RPW][BITS] = qd[di];
                float (&s)[RPW] = sd[di];
                float (&b)[RPW] = bd[di];
""" + _ROW_LOADS

# Each of the warp's rows' share of chunk ``di`` (its codes against x's floats ``xf``, then
# the chunk's scale and bias), and the one-row sources' end: the lanes' sums met by
# shuffles, lane r writing row r.
_ROW_SUMS = r"""            #pragma unroll
            for (int r = 0; r < RPW; ++r) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                #pragma unroll
                for (int j = 0; j < 32; ++j) {
""" + _CODE + r"""                    d[j & 3] += xf[j] * f;
                }
                acc[r] += CHUNK(sd[di][r], bd[di][r], (d[0] + d[1]) + (d[2] + d[3]), xs);
            }
"""
_REDUCE_STORE = r"""    float red[RPW];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) {
        float v = acc[r];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        red[r] = v;
    }
    #pragma unroll
    for (int r = 0; r < OUTS; ++r) {
        if (lane == r && n0 + r < N) STORE(0, n0 + r, OUTPUT(red[r], red[(r + OUTS) % RPW]));
    }
"""

# One row of x. Each lane takes DEPTH of its chunks at a time (``di``: ``u`` names a word
# of codes in the row loads), every load of all DEPTH issued before any use (codes,
# scales and biases of each row, and x's raw values), so a warp keeps DEPTH times the
# bytes in flight: at one row a product of an 8B's layers is a few chunks a lane (4 at
# K = 4,096), and with one chunk in flight each is a wait on memory. DEPTH 1 is the
# first form.
_SOURCE = _START + r"""
    float acc[RPW];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;

    for (int c0 = lane; c0 < chunks; c0 += 32 * DEPTH) {
        uint32_t qd[DEPTH][RPW][BITS];
        float sd[DEPTH][RPW], bd[DEPTH][RPW];
        uint4 xd[DEPTH][4];
""" + _DEPTH_LOADS + r"""                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)c * 32);
                #pragma unroll
                for (int v = 0; v < 4; ++v) xd[di][v] = xp[v];
            }
        }
        #pragma unroll
        for (int di = 0; di < DEPTH; ++di) {
            if (c0 + 32 * di >= chunks) break;
            uint32_t (&q)[RPW][BITS] = qd[di];
""" + _X_FLOATS.replace("XRAW", "xd[di]") + _ROW_SUMS + r"""        }
    }
""" + _REDUCE_STORE


# A few rows of x (a decode step of 2-8 streams): each chunk's codes of every weight row
# made floats once, then each row of x's 32 values loaded, made float and summed once and
# taken against every weight row: the same sums per (weight row, x row) as one row's.
_ROWS_SOURCE = _START + r"""
    int rows = 1;
    for (int i = 0; i + 1 < x_ndim; ++i) rows *= x_shape[i];

    float acc[RPW][MAXR];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) {
        #pragma unroll
        for (int m = 0; m < MAXR; ++m) acc[r][m] = 0.0f;
    }

    for (int c = lane; c < chunks; c += 32) {
""" + _LOAD_ROWS + r"""
        // every weight row's codes as floats, once a chunk: they serve every row of x
        float wf[RPW][32];
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            #pragma unroll
            for (int j = 0; j < 32; ++j) {
""" + _CODE + r"""                wf[r][j] = f;
            }
        }
        // each row of x: its 32 values of this chunk made float and summed once, then
        // against every weight row
        #pragma unroll
        for (int m = 0; m < MAXR; ++m) {
            if (m < rows) {
""" + _LOAD_X.replace("XROW", "x + (size_t)m * K") + r"""
                #pragma unroll
                for (int r = 0; r < RPW; ++r) {
                    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    #pragma unroll
                    for (int j = 0; j < 32; ++j) d[j & 3] += xf[j] * wf[r][j];
                    acc[r][m] += CHUNK(s[r], b[r], (d[0] + d[1]) + (d[2] + d[3]), xs);
                }
            }
        }
    }
    float red[RPW][MAXR];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) {
        #pragma unroll
        for (int m = 0; m < MAXR; ++m) {
            float v = acc[r][m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            red[r][m] = v;
        }
    }
    #pragma unroll
    for (int r = 0; r < OUTS; ++r) {
        #pragma unroll
        for (int m = 0; m < MAXR; ++m) {
            if (lane == 0 && m < rows && n0 + r < N)
                STORE(m, n0 + r, OUTPUT(red[r][m], red[(r + OUTS) % RPW][m]));
        }
    }
"""


# One row of x staged in shared memory (a launch shape's fifth number, ``TILES``, past 0):
# the block first copies x in (``xs4[v][c]``: values 8v..8v+7 of chunk c, so the lanes'
# 16-byte reads of consecutive chunks are consecutive) with each chunk's sum (``xsum``),
# then each warp takes TILES row tiles of the block in turn, its loads only the weights'.
# Why: the one-row source's lanes load their 64 bytes of x per chunk from L1 beside the
# 16 bytes of each 4-bit weight row, held in registers while the weights are in flight,
# and sum them again per warp; on the H100 the 4-bit products stayed at ~52% of the
# card's bandwidth at every launch shape and depth, where the 6-bit output layer (fewer
# x loads a weight byte) reached 81%. Timed by one load (H100, 12-06): it took a staged
# shape for the 6-bit 14336x4096 product only, and that lease served one stream slower
# than ever (with the other 12-06 additions; the cause not isolated), so it is off unless
# GMLX_STAGED=1, which has the tuner time it beside the other shapes.
_STAGED_SOURCE = _LAYOUT + r"""
    __shared__ uint4 xs4[4][XCHUNKS];
    __shared__ float xsum[XCHUNKS];
    {
        const uint4* xg = reinterpret_cast<const uint4*>(x);
        for (int base = 0; base < 4 * XCHUNKS; base += 32 * WARPS) {
            const int i = base + threadIdx.x;
            float part = 0.0f;
            if (i < 4 * XCHUNKS) {
                const uint4 raw = xg[i];
                xs4[i & 3][i >> 2] = raw;
                const T* e = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int j = 0; j < 8; ++j) part += static_cast<float>(e[j]);
            }
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            if (i < 4 * XCHUNKS && (i & 3) == 0) xsum[i >> 2] = part;
        }
    }
    __syncthreads();
    for (int tile = 0; tile < TILES; ++tile) {
        const int n0 = ((blockIdx.x * TILES + tile) * WARPS + warp) * OUTS;
        if (n0 >= N) break;
        float acc[RPW];
        #pragma unroll
        for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
        for (int c0 = lane; c0 < chunks; c0 += 32 * DEPTH) {
            uint32_t qd[DEPTH][RPW][BITS];
            float sd[DEPTH][RPW], bd[DEPTH][RPW];
""" + _DEPTH_LOADS + r"""                }
            }
            #pragma unroll
            for (int di = 0; di < DEPTH; ++di) {
                const int c = c0 + 32 * di;
                if (c >= chunks) break;
                uint32_t (&q)[RPW][BITS] = qd[di];
                uint4 xr[4];
                #pragma unroll
                for (int v = 0; v < 4; ++v) xr[v] = xs4[v][c];
                float xf[32];
                #pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const T* e = reinterpret_cast<const T*>(&xr[v]);
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) xf[8 * v + j] = static_cast<float>(e[j]);
                }
                const float xs = xsum[c];
""" + _ROW_SUMS + r"""            }
        }
""" + _REDUCE_STORE + r"""    }
"""
STAGED_BYTES = 48 * 1024  # a block's static shared memory at most: x (2 bytes a value) and its chunks' sums
STAGED_ENV = "GMLX_STAGED"  # 1: the staged shapes timed; else none, and one a load kept runs as its unstaged twin


def staged() -> bool:
    """Whether the staged shapes are timed and taken (``GMLX_STAGED=1``: off by default
    until a served run measures them; see ``_STAGED_SOURCE``)."""
    return os.environ.get(STAGED_ENV, "0") == "1"


def stages(k: int) -> bool:
    """Whether the staged shapes are taken (:func:`staged`) and one row of ``k`` values
    fits their shared memory."""
    return staged() and 2 * k + 4 * (k // 32) <= STAGED_BYTES


def unstaged(config: tuple[int, ...]) -> tuple[int, ...]:
    """``config`` without x staged (the same warps, rows a warp and depth)."""
    warps, rpw, max_rows, depth, _ = launch_shape(config)
    return (warps, rpw, max_rows, depth)


def supports(rows: int, k: int, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a product of this shape may take the kernel (the tuner still measures)."""
    return (mode == "affine" and 1 <= rows <= MAX_ROWS and bits in BITS and group_size in GROUPS
            and k % group_size == 0 and k % 32 == 0)


def layout(layer: Any) -> tuple[int, int, str, int, Any] | None:
    """``(group_size, bits, mode, K, scales' dtype)`` of a quantized linear layer without a
    bias whose one-row product the kernel takes (the gated and parts products read
    layers that share one), else None."""
    from mlx import nn

    if not isinstance(layer, nn.QuantizedLinear) or "bias" in layer:
        return None
    mode = getattr(layer, "mode", "affine")
    k = layer.weight.shape[1] * 32 // layer.bits
    if not supports(1, k, layer.group_size, layer.bits, mode):
        return None
    return layer.group_size, layer.bits, mode, k, layer.scales.dtype


# one row, x staged in shared memory: (warps, rows a warp, 1, chunks a lane in flight, row tiles a block)
STAGED = [(8, 2, 1, 1, 1), (8, 2, 1, 2, 2), (8, 4, 1, 1, 2), (16, 2, 1, 2, 1)]


def configs(rows: int = 1, k: int = 0) -> list[tuple[int, ...]]:
    """The launch shapes the load-time tuner times for a bucket of ``rows`` rows: (warps
    per block, weight rows per warp), and for more than one row of x the rows it takes
    at most (the bucket); at one row a fourth, the chunks each lane has in flight
    (``DEPTH``, 1 where absent), and a fifth, the row tiles a block takes with x staged
    in its shared memory (:data:`STAGED`; given ``k``, the row's width, where it fits)."""
    if rows == 1:  # (warps, rows a warp, 1, chunks a lane in flight): the last three, depth 2
        return [(4, 2), (8, 2), (4, 4), (8, 1), (4, 2, 1, 2), (8, 2, 1, 2), (4, 4, 1, 2),
                *(STAGED if k and stages(k) else [])]
    return [(4, 1, rows), (4, 2, rows)]  # two: each one compiles at a first load's tuning


def gated_configs(rows: int = 1, k: int = 0) -> list[tuple[int, ...]]:
    """The launch shapes of the gated product (:func:`bound` with ``up``) for a bucket of
    ``rows`` rows: (warps per block, weight rows per warp (half gate, half up), rows of x
    at most[, chunks a lane in flight[, row tiles a block, x staged]]). The first is the
    default; at one row the load times them all (:func:`glu_cuda.tune`)."""
    if rows > 1:
        return [(4, 2, rows)]
    return [(4, 4, 1), (4, 2, 1), (4, 4, 1, 2),
            *([(8, 4, 1, 1, 1), (8, 4, 1, 2, 2), (16, 2, 1, 2, 1)] if k and stages(k) else [])]


_BODY = compact(_SOURCE)
_ROWS_BODY = compact(_ROWS_SOURCE)
_STAGED_BODY = compact(_STAGED_SOURCE)


# What a product's rows are and what it writes: a plain product's warp takes RPW weight
# rows and writes each; a gated one's (``glu``) takes RPW / 2 rows of the gate's weights
# and the same rows of the up projection's (``w2``...), and writes silu(gate) * up for
# each, rounded as MLX's products and its swiglu round them (each product to T, then
# sigmoid, the product with it and the one with up, each to T).
_PLAIN = """constexpr int OUTS = RPW;
#define ROWS_TOTAL w_shape[0]
#define ROW_W(r, n) (w + (size_t)(n) * words)
#define ROW_S(r, n) (scales + (size_t)(n) * groups)
#define ROW_B(r, n) (biases + (size_t)(n) * groups)
#define OUTPUT(v, u) static_cast<T>(v)
#define STORE(m, n, v) out[(size_t)(m) * N + (n)] = (v)
"""
_GATED = """constexpr int OUTS = RPW / 2;
#define ROWS_TOTAL w_shape[0]
#define ROW_W(r, n) (((r) < OUTS ? w : w2) + (size_t)(n) * words)
#define ROW_S(r, n) (((r) < OUTS ? scales : scales2) + (size_t)(n) * groups)
#define ROW_B(r, n) (((r) < OUTS ? biases : biases2) + (size_t)(n) * groups)
""" + SWIGLU + """#define OUTPUT(g, u) gmlx_swiglu(g, u)
#define STORE(m, n, v) out[(size_t)(m) * N + (n)] = (v)
"""


def _parts_head(sizes: tuple[int, ...]) -> str:
    """A product over two or three layers of one layout and input (an attention's
    queries, keys and values), their weight rows one after another (``sizes`` rows each)
    and each written to its own output: ``w, scales, biases`` then ``w2...`` and ``w3...``;
    ``out``, ``out2``, ``out3``."""
    suffix = ["", "2", "3"][:len(sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def pick(prefix: str, per: str) -> str:  # the part row n lies in, and n's row in it
        expr = f"({prefix}{suffix[-1]} + (size_t)((n) - {starts[-1]}) * {per})"
        for i in range(len(sizes) - 2, -1, -1):
            expr = f"((n) < {starts[i + 1]} ? {prefix}{suffix[i]} + (size_t)((n) - {starts[i]}) * {per} : {expr})"
        return expr

    store = "out" + suffix[-1] + f"[(size_t)(m) * {sizes[-1]} + (n) - {starts[-1]}] = (v);"
    for i in range(len(sizes) - 2, -1, -1):
        store = (f"if ((n) < {starts[i + 1]}) out{suffix[i]}[(size_t)(m) * {sizes[i]} + (n) - {starts[i]}] = (v); "
                 f"else {{ {store} }}")
    return (f"constexpr int OUTS = RPW;\n#define ROWS_TOTAL {sum(sizes)}\n"
            f"#define ROW_W(r, n) {pick('w', 'words')}\n"
            f"#define ROW_S(r, n) {pick('scales', 'groups')}\n"
            f"#define ROW_B(r, n) {pick('biases', 'groups')}\n"
            "#define OUTPUT(v, u) static_cast<T>(v)\n"
            f"#define STORE(m, n, v) {{ {store} }}\n")


@cache
def _kernel(dtype: Any, bits: int, group_size: int, warps: int, rpw: int, max_rows: int = 1,
            gated: bool = False, parts: tuple[int, ...] = (), depth: int = 1, tiles: int = 0, k: int = 0) -> Any:
    """One kernel per layout and launch shape (:mod:`cuda_source` says why); more than
    one row of x (``max_rows``) takes the few-rows source; ``gated``: silu(gate) * up of
    two layers of one layout (``rpw`` even: half its rows each); ``parts``: the row counts
    of two or three layers of one layout read as one, each written to its own output;
    ``depth``: at one row, the chunks a lane loads before using any; ``tiles``: at one
    row, x staged in shared memory (``k`` values) and that many row tiles a block."""
    t = cuda_type(dtype)
    head = (f"using T = {t}; constexpr int BITS = {bits}; constexpr int G = {group_size}; "
            f"constexpr int WARPS = {warps}; constexpr int RPW = {rpw};"
            + (f" constexpr int MAXR = {max_rows};" if max_rows > 1 else f" constexpr int DEPTH = {depth};")
            + (f" constexpr int TILES = {tiles}; constexpr int XCHUNKS = {k // 32};" if tiles else "") + "\n"
            + (_GATED if gated else _parts_head(parts) if parts else _PLAIN))
    layers = 2 if gated else max(1, len(parts))
    inputs, outputs = layer_names(layers, len(parts) or 1)
    kind = "qglu" if gated else f"qparts{len(parts)}" if parts else "qgemv"
    body = _ROWS_BODY if max_rows > 1 else _STAGED_BODY if tiles else _BODY
    return build(f"gmlx_{kind}_{t.strip('_')}_{bits}_{group_size}_{warps}_{rpw}_{max_rows}"
                 + (f"_d{depth}" if depth > 1 else "") + (f"_x{tiles}" if tiles else ""),
                 head, body, inputs, outputs=outputs)


def launch_shape(config: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """A launch shape of :func:`configs` or :func:`gated_configs` in full: (warps per
    block, weight rows per warp, rows of x at most, chunks a lane in flight, row tiles a
    block with x staged (0: not staged))."""
    warps, rpw, *most = config
    return (warps, rpw, most[0] if most else 1, most[1] if len(most) > 1 else 1,
            most[2] if len(most) > 2 else 0)


def kernel_of(dtype: Any, bits: int, group_size: int, config: tuple[int, ...], gated: bool = False,
              parts: tuple[int, ...] = (), k: int = 0) -> Any:
    """The kernel for this layout at the launch shape ``config`` (:func:`launch_shape`),
    for rows of ``k`` values (the staged shapes are built for one width)."""
    warps, rpw, max_rows, depth, tiles = launch_shape(config)
    return _kernel(dtype, bits, group_size, warps, rpw, max_rows, gated, parts, depth, tiles, k if tiles else 0)


def bound(w: Any, scales: Any, biases: Any, group_size: int, bits: int,
          config: tuple[int, ...] | None = None, up: tuple[Any, Any, Any] | None = None,
          more: tuple[tuple[Any, Any, Any], ...] = ()) -> Callable[[Any], Any]:
    """``gemv`` of this layer's weights as a function of ``x`` alone, its launch worked
    out once (a layer calls it on every decode step of one stream); with ``up`` (the up
    projection's weights, scales and biases, of this layer's layout and shape) the gated
    product ``silu(x @ W.T) * (x @ U.T)``, ``config``'s rows per warp then even; with
    ``more`` (one or two more layers' weights, scales and biases, of this layer's layout
    and input width) the products of all of them in one launch, returned as a tuple."""
    sizes = tuple(a[0].shape[0] for a in ((w,), *more)) if more else ()
    n = sum(sizes) if more else w.shape[0]
    config = config or configs()[0]
    k = w.shape[1] * 32 // bits
    if launch_shape(config)[4] and not stages(k):  # turned off (a kept tuning's shape runs unstaged), or too wide
        if staged():
            raise ValueError(f"a row of {k} values does not fit the staged source's shared memory")
        config = unstaged(config)
    warps, rpw, _, _, tiles = launch_shape(config)
    outs = rpw // 2 if up is not None else rpw
    grid = (-(-n // (warps * outs * max(tiles, 1))) * 32 * warps, 1, 1)
    threadgroup = (32 * warps, 1, 1)
    inputs_after_x = [w, scales, biases, *(up or ()), *(a for layer in more for a in layer)]
    kernels: dict[Any, Any] = {}  # per activation dtype

    def run(x: Any) -> Any:
        dtype = x.dtype
        kernel = kernels.get(dtype)
        if kernel is None:
            kernel = kernels[dtype] = kernel_of(dtype, bits, group_size, config, up is not None, sizes, k)
        lead = x.shape[:-1]
        outs = kernel(inputs=[x, *inputs_after_x], grid=grid, threadgroup=threadgroup,
                      output_shapes=[(*lead, m) for m in (sizes or (n,))], output_dtypes=[dtype] * (len(sizes) or 1))
        return tuple(outs) if more else outs[0]

    return run


def gemv(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int,
         config: tuple[int, ...] | None = None) -> Any:
    """``x [..., K] @ dequantize(w [N, K*bits/32], scales, biases).T`` -> ``[..., N]``
    for one row of ``x`` (bf16 or fp16)."""
    return bound(w, scales, biases, group_size, bits, config)(x)
