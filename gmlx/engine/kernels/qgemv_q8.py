"""The one-row 4-bit products with x rounded to 8 bits a chunk once a block, and the codes
summed against it four at a time (on by default; ``GMLX_Q8X=0``: the float sums): the
source, and where a product takes it. Served on an H200 (2026-12-07, the 8B's Q4_K_M, one
stream): 313.0 and 335.8 tok/s against 293.6 with the float sums, 239.7 for llama-server
on the same file in the same lease.

Why: counted in sm_90 machine code (``benchmarks/gpu/sass_count.py``), the float sums
take two instructions a code (a byte permute under 0.5's exponent, a multiply-add), so
the 8B's normed gate-up-swiglu at 4x4 runs ~73 instructions a row a chunk of 32 codes
besides x's side, and x prepared once a block (:mod:`qgemv_prepared`) still leaves 426 a
4-row chunk. Its loop then fills about as many of an H200's issue slots as its bytes fill
of the memory's time, and the products read at 0.3-1.8 TB/s of the card's 4.8 (12-06
night). Summed as integers, a word of eight codes is two masks and two 4-way byte
products (``__dp4a``) against x's bytes: ~5 instructions for 8 codes, ~24 a row a
chunk with the scale and bias. That is what llama.cpp's quantized products do with
their activations (Q8_1), and it leaves the loop bound by memory, not by its issue.

The block first loads each warp's first chunk of weights (its wait overlaps the rest),
then rounds x. Each thread takes whole chunks of 32 values: their floats (``h * nw`` with
the norm folded in, else x as it is), the largest magnitude ``a``, and each value rounded
to the nearest of ``-127..127`` in steps of ``d = a / 127``, the bytes of a word's even
codes in one word and its odd codes' in the next (as the masks leave the codes), written
to shared memory with ``d`` and the chunk's float sum. A row's chunk is then ``s * d * dot
+ b * sum(x)`` with ``dot`` the integer sum of the codes against x's bytes: exact, so the
only change from float sums is x's rounding, at most ``d / 2`` a value (``a / 254``). The
norm's scale (``rsqrt(mean(h^2) + eps)``) does not change a chunk's rounding, so the same
pass sums the squares, the block meets once, and each output is scaled as it is written.
The output is not MLX's bits and is further from a float32 product than MLX's own (whose
x is float16): :data:`TOLERANCE` states how far a load allows. Each warp loads its next chunk's weights
while summing the current one; the tuners also time shapes with 2-4 chunks a lane in
flight, the first of them loaded before the block rounds x (:func:`deep`; off with
``GMLX_Q8_DEPTH=0``). The 6-bit products round x too (``GMLX_Q8X=all``, the default;
``1``: the 4-bit ones alone).
"""

from __future__ import annotations

import os

from gmlx.engine.kernels import qgemv_split, timing
from gmlx.engine.kernels.qgemv_prepared import chunk_loop

ENV = "GMLX_Q8X"
DEEP_ENV = "GMLX_Q8_DEPTH"
SHARED_BYTES = 48 * 1024  # a block's static shared memory at most
# a product taking this source is held to twice MLX's error from a float32 product plus
# this much of its largest value (MLX's own products: 0.001; :func:`timing.agrees`). x's
# rounding is at most 1/254 of a chunk's largest value a value, ~1/60 of x's RMS a step;
# over K values of random sign it adds ~1/200 of a product's RMS: 0.5-0.8% of the largest
# of 256 random outputs, 0.8-1.3% where a few of x's values are ~40x the rest (measured
# in the tests at K = 4,096 and 14,336)
TOLERANCE = 0.03


def q8x() -> bool:
    """Whether one-row 4-bit products round x to bytes (on unless ``GMLX_Q8X=0``; CUDA
    alone builds these products)."""
    return os.environ.get(ENV, "all") != "0"


def deep() -> bool:
    """Whether the rounded products also run with several chunks a lane in flight (on
    unless ``GMLX_Q8_DEPTH=0``): :data:`DEEP` shapes timed beside the others, and the
    depth-2 shapes rounded too (else their float sums). Why: a lane
    of an 8B's product at one row takes 4 chunks (K = 4,096) to 14, and with one chunk
    in flight each is a wait on memory; its rounded gate-up-swiglu read at 2.27 TB/s of
    the H100's 3.35 (ncu, 12-07), and on the H200 one stream is no faster for the
    card's 43% more bandwidth. With DEPTH 4 a lane's whole row of K = 4,096 is in flight
    before the block rounds x. Measured with the split shapes and the 6-bit products
    rounded (``gmlx-inflight``, H100, 12-07, the synthetic 8B's served step in process):
    the gate-up-swiglu took 4x2 depth 4 (29.0 against 32.8 us), the 4-bit down products 8x2
    depth 4 (16.8 against 19.1), the output layer 4x2 depth 4 (150 against 167)."""
    return os.environ.get(DEEP_ENV, "1") != "0"


# the launch shapes (warps, rows a warp, 1, chunks a lane in flight) the one-row tuners
# also time where :func:`deep`: at K = 4,096 a lane's whole row in flight at once; the
# last (4 rows a warp, 16 chunks a lane in registers: 168 a thread for the gate-up, sm_90)
# only up to :data:`WIDEST_DEEP` values, past which it runs out of registers (the 8B's
# 14,336-wide down products: 240-255 a thread)
DEEP = [(4, 2, 1, 4), (8, 2, 1, 4), (4, 4, 1, 4)]
WIDEST_DEEP = 4096


def deep_shapes(k: int = 0) -> list[tuple[int, ...]]:
    """:data:`DEEP` where :func:`deep` (its last shape only for a row of at most
    :data:`WIDEST_DEEP` values, ``k``; 0: unknown, all), else none."""
    if not deep():
        return []
    return [c for c in DEEP if c[1] * c[3] < 16 or not k or k <= WIDEST_DEEP]


def key(bits: int) -> str:
    """What a one-row product's tuning key takes on for what its shapes run: ``:q8``
    where its bits round x (:func:`rounds`), ``:deep`` where :func:`deep` adds shapes
    (and rounds the deeper ones), ``:q8split`` where the split shapes
    (``GMLX_SPLIT_K``, on by default) round x too (before, they summed floats): a load with other
    settings times again rather than read a shape it would not have timed or that ran
    another source."""
    return (":q8" if rounds(bits) else "") + (":deep" if deep() else "") + (
        ":q8split" if rounds(bits) and qgemv_split.splitting() else "")


def trying() -> bool:
    """Whether the 6-bit products round x too (``GMLX_Q8X=all``, the default; ``1``: the
    4-bit ones alone)."""
    return os.environ.get(ENV, "all") == "all"


def rounds(bits: int) -> bool:
    """Whether one-row products of ``bits``-bit codes round x to bytes: 4- and 6-bit
    ones (``GMLX_Q8X=all``, the default; ``1``: 4-bit ones alone). Each group of four
    6-bit codes becomes four bytes in 5 instructions, where the float sums take ~4 a code:
    the 8B's 6-bit down products took 22.2 us split two ways against 25.7 (H100, 12-07,
    ``gmlx-inflight``), the 6-bit output layer 150 against 167."""
    return q8x() and (bits == 4 or (bits == 6 and trying()))


def tolerance(bits: int, rows: int = 1) -> float:
    """What a load allows a kernel's product of ``rows`` rows of ``bits``-bit codes beyond
    twice MLX's error, as a share of its largest output (:func:`timing.agrees`):
    :data:`TOLERANCE` where this source may take it (one row, :func:`rounds`), else MLX's
    own (:data:`timing.TOLERANCE`)."""
    return TOLERANCE if rounds(bits) and rows == 1 else timing.TOLERANCE


def shared_bytes(k: int, warps: int, split_rows: int = 0) -> int:
    """A block's shared memory for a row of ``k`` values: x's bytes, each chunk's step and
    sum, and each warp's share of the squares' sum; where K is split between warps, each
    warp's sums of its ``split_rows`` rows and a squares' slot too."""
    return k + 8 * (k // 32) + 4 * warps + (4 * warps * (split_rows + 1) if split_rows else 0)


def fits(k: int, warps: int, split_rows: int = 0) -> bool:
    """Whether a row of ``k`` values can be rounded in a block of ``warps`` warps
    (``split_rows``: :func:`shared_bytes`)."""
    return shared_bytes(k, warps, split_rows) <= SHARED_BYTES


# the gated products' shapes of more warps a block, timed beside the others where x is
# rounded (:func:`shapes`): each block rounds the whole row (the normed gate-up: 16 KB of
# the hidden state and the norm's weight read a block, ~250 instructions a chunk of x), so
# twice the rows a block halves that part of the product
GATED = [(8, 4, 1), (8, 2, 1)]


def shapes(gated: bool) -> list[tuple[int, ...]]:
    """The launch shapes a one-row product is timed in beside the others where x is
    rounded (:data:`GATED`; the plain ones already have 8 warps a block)."""
    return list(GATED) if gated and q8x() else []


def takes(bits: int, k: int, warps: int, depth: int, whole: bool, split: int = 1, rpw: int = 0) -> bool:
    """Whether a one-row product takes this source: its bits round (:func:`rounds`), one
    unstaged row, not streamed (``whole``), a chunk a lane in flight (``depth`` 1) or
    more where :func:`deep`, or K split between ``split`` warps at one chunk a lane in
    flight (:func:`qgemv_split.split_rounded`; ``rpw`` rows a group of them), and its row
    fits."""
    return (rounds(bits) and whole and (depth == 1 or (deep() and split == 1)) and k > 0 and k % 32 == 0
            and fits(k, warps, rpw if split > 1 else 0))


def source(layout: str, row_loads: str, reduce_store: str, normed: bool, deep: bool = False) -> str:
    """The source from the one-row source's parts: the layout's sizes, a chunk's loads of
    each row's codes, scale and bias (into ``q``, ``s``, ``b`` at chunk ``c``), and the
    lanes' meeting and store (each as :mod:`qgemv_source` has them); ``normed``: the norm
    before the product folded in (its weight the input ``nw``, ``EPS`` in the head);
    ``deep``: ``DEPTH`` chunks a lane in flight (:func:`deep`, ``DEPTH`` in the head), the
    first ``DEPTH`` loaded before x is rounded (:func:`_deep_loop`), else one.

    The norm's scale is a number a row, and a chunk's rounding does not change with it
    (each value over the chunk's largest), so the block rounds ``h * nw`` and sums its
    squares in the same pass, and each output is scaled as it is written."""
    value = "static_cast<float>(e[j]) * static_cast<float>(g[j])" if normed else "static_cast<float>(e[j])"
    squares = "ss += static_cast<float>(e[j]) * static_cast<float>(e[j]);" if normed else ""
    store = reduce_store
    if normed:
        old = "        red[r] = v;\n    }\n"
        if store.count(old) != 1:
            raise AssertionError("the one-row store changed: its sums are not met once")
        store = store.replace(old, old + r"""    float total = 0.0f;
    #pragma unroll
    for (int i = 0; i < WARPS; ++i) total += wss[i];
    const float scale = rsqrtf(total / (float)K + EPS);
    #pragma unroll
    for (int r = 0; r < RPW; ++r) red[r] *= scale;
""")
    return layout + r"""
    const int n0 = (blockIdx.x * WARPS + warp) * OUTS;
    __shared__ __align__(16) uint4 xq[2][XCHUNKS];  // chunk c's 32 bytes: words 0-3 at [0][c], 4-7 at [1][c]
    __shared__ float2 xds[XCHUNKS];                 // chunk c's step and float sum
    __shared__ float wss[WARPS];                    // each warp's share of the squares' sum
""" + (_DEEP_FIRST if deep else _FIRST) + row_loads + r"""    }
    // x's chunks rounded to bytes, each with its step and float sum, once for the block; a
    // value's byte is the low byte of its float plus 1.5 * 2^23 (the add rounds it, ties to
    // even), four gathered by byte permutes
    float ss = 0.0f;
    for (int i = threadIdx.x; i < chunks; i += 32 * WARPS) {
        const uint4* hp = reinterpret_cast<const uint4*>(x + (size_t)i * 32);
        """ + ("const uint4* gp = reinterpret_cast<const uint4*>(nw + (size_t)i * 32);" if normed else "") + r"""
        float f[32];
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
            const uint4 hr = hp[v];
            const T* e = reinterpret_cast<const T*>(&hr);
            """ + ("const uint4 gr = gp[v];\n            const T* g = reinterpret_cast<const T*>(&gr);"
                   if normed else "") + r"""
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                f[8 * v + j] = """ + value + r""";
                """ + squares + r"""
            }
        }
        float most = 0.0f, part = 0.0f;
        #pragma unroll
        for (int j = 0; j < 32; ++j) {
            most = fmaxf(most, fabsf(f[j]));
            part += f[j];
        }
        const float inv = most > 0.0f ? 127.0f / most : 0.0f;
        uint32_t wd[8];
        #pragma unroll
        for (int u = 0; u < 4; ++u) {  // 4-bit, codes 8u..8u+7: the even ones' bytes, then the odd ones' (6-bit: in order)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned r4[4];
                #pragma unroll
                for (int t = 0; t < 4; ++t)
                    r4[t] = __float_as_uint(fmaf(f[BITS == 4 ? 8 * u + 2 * t + h : 8 * u + 4 * h + t], inv, 12582912.0f));
                wd[2 * u + h] = __byte_perm(__byte_perm(r4[0], r4[1], 0x0040), __byte_perm(r4[2], r4[3], 0x0040), 0x5410);
            }
        }
        xq[0][i] = uint4{wd[0], wd[1], wd[2], wd[3]};
        xq[1][i] = uint4{wd[4], wd[5], wd[6], wd[7]};
        xds[i] = float2{most / 127.0f, part};
    }
    """ + (r"""#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) wss[warp] = ss;
    """ if normed else "") + r"""__syncthreads();
""" + (_deep_loop if deep else chunk_loop)(row_loads, r"""        const uint4 xa = xq[0][c0], xb = xq[1][c0];
        const int xw[8] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w, (int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
        const float2 ds = xds[c0];
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            int dot = 0;
            if (BITS == 4) {
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    dot = __dp4a((int)(q[r][u] & 0x0F0F0F0Fu), xw[2 * u], dot);
                    dot = __dp4a((int)((q[r][u] >> 4) & 0x0F0F0F0Fu), xw[2 * u + 1], dot);
                }
            } else {  // 6-bit: each three words are four groups of four codes (24 bits), each group four bytes
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t w0 = q[r][3 * h], w1 = q[r][3 * h + 1], w2 = q[r][3 * h + 2];
                    const uint32_t v[4] = {w0, __funnelshift_r(w0, w1, 24), __funnelshift_r(w1, w2, 16), w2 >> 8};
                    #pragma unroll
                    for (int t = 0; t < 4; ++t) {
                        const uint32_t u = (v[t] & 0xFFFu) | ((v[t] << 4) & 0x0FFF0000u);  // codes 0-1 low, 2-3 high
                        dot = __dp4a((int)((u & 0x003F003Fu) | ((u << 2) & 0x3F003F00u)), xw[4 * h + t], dot);
                    }
                }
            }
            acc[r] += s[r] * (ds.x * (float)dot) + b[r] * ds.y;
        }
""") + store


# The first chunk's weights of each of a warp's rows, loaded before the block rounds x (its
# wait overlaps that), or the first ``DEPTH`` chunks' (each past the end: read, never used).
_FIRST = r"""    // this warp's first chunk (past the end: read, never written), before x is made
    uint32_t q[RPW][BITS];
    float s[RPW], b[RPW];
    {
        const int c = min(lane, chunks - 1);
"""
_DEEP_FIRST = r"""    // this warp's first DEPTH chunks (past the end: read, never used), before x is made
    uint32_t qd[DEPTH][RPW][BITS];
    float sd[DEPTH][RPW], bd[DEPTH][RPW];
    #pragma unroll
    for (int di = 0; di < DEPTH; ++di) {
        const int c = min(lane + 32 * di, chunks - 1);
        uint32_t (&q)[RPW][BITS] = qd[di];
        float (&s)[RPW] = sd[di];
        float (&b)[RPW] = bd[di];
"""


def _deep_loop(row_loads: str, body: str) -> str:
    """:func:`qgemv_prepared.chunk_loop` with ``DEPTH`` chunks a lane in flight: warps
    past the last row leave, then each group of a lane's ``DEPTH`` chunks is summed
    (``body``, a chunk at ``c0`` from ``q``, ``s`` and ``b``) while the next group's
    weights are in flight (``row_loads`` into ``qn``, ``sn`` and ``bn``); a chunk past the
    row's end is neither loaded nor summed. The bounds are ``XCHUNKS``, a constant, so at
    K = 4,096 and ``DEPTH`` 4 the loop is one pass, every load issued before x was made."""
    return r"""    if (n0 >= N) return;
    float acc[RPW];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
    for (int g0 = lane; g0 < XCHUNKS; g0 += 32 * DEPTH) {
        // the next group's weights in flight while this one is summed
        uint32_t qn[DEPTH][RPW][BITS];
        float sn[DEPTH][RPW], bn[DEPTH][RPW];
        #pragma unroll
        for (int di = 0; di < DEPTH; ++di) {
            const int c = g0 + 32 * (DEPTH + di);
            if (c < XCHUNKS) {
                uint32_t (&q)[RPW][BITS] = qn[di];
                float (&s)[RPW] = sn[di];
                float (&b)[RPW] = bn[di];
""" + row_loads + r"""            }
        }
        #pragma unroll
        for (int di = 0; di < DEPTH; ++di) {
            const int c0 = g0 + 32 * di;
            if (c0 < XCHUNKS) {
                const uint32_t (&q)[RPW][BITS] = qd[di];
                const float (&s)[RPW] = sd[di];
                const float (&b)[RPW] = bd[di];
""" + body + r"""            }
        }
        #pragma unroll
        for (int di = 0; di < DEPTH; ++di) {
            #pragma unroll
            for (int r = 0; r < RPW; ++r) {
                #pragma unroll
                for (int i = 0; i < BITS; ++i) qd[di][r][i] = qn[di][r][i];
                sd[di][r] = sn[di][r];
                bd[di][r] = bn[di][r];
            }
        }
    }
"""
