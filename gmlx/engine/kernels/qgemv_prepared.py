"""The one-row products with the norm folded in, their x prepared once a block
(``GMLX_PREPARED=1``; off by default until a lease serves it): the source, and where a
product takes it.

Why: the normed one-row source (``qgemv_source.NORMED_BODY``) has every warp make x's
floats itself. For each chunk a warp converts the hidden state's 32 values and the norm
weight's 32 to floats, multiplies them, sums their squares for the norm and sums the
products for the bias term. That is ~190 of the 591 machine instructions a 4-row chunk
of the 8B's normed gate-up-swiglu at 4x4 (sm_90 SASS, counted by
``benchmarks/gpu/sass_count.py``), done again by each of a block's warps and each block.
At 4x2 it is ~180 of 386. The gate-up's loop issues ~20 us of an H200's issue slots
against its 40 us a layer (12-06 night), so the products' instructions are half their
time. (Sums in half pairs were meant to cut them and measured no faster on 12-07: their
SASS loop was as long as the float sums', 587 against 591 instructions; removed.)

Here a block prepares x once. First it loads its warps' first chunk of weights, so their
wait on memory overlaps the rest. Its threads then sum the hidden state's squares, and
the block meets at a barrier. Each thread writes its chunks' 32 values of ``h * nw *
rsqrt(mean(h^2) + eps)`` as floats into shared memory, with each chunk's sum, and the
block meets again. Each warp's loop then reads its chunk's floats and sum from shared
memory: 9 loads in place of ~190 instructions. It loads the next chunk's weights before
summing the current one, one chunk ahead in registers. The sums of the codes against x
are the normed source's (the same byte permutes and multiply-adds); x is scaled before
the sums, not after, so the output is as near a float32 norm and product, not the same
bits. x's floats take 4 bytes a value of the block's shared memory (a hidden state of
4,096: 16.5 KB), so a row of at most ~11,900 values is prepared.
"""

from __future__ import annotations

import os

ENV = "GMLX_PREPARED"
SHARED_BYTES = 48 * 1024  # a block's static shared memory at most


def prepared() -> bool:
    """Whether normed one-row products prepare x once a block (``GMLX_PREPARED=1``: the
    gated ones; ``all``: every one)."""
    return os.environ.get(ENV, "0") in ("1", "all")


def takes(gated: bool) -> bool:
    """Whether a normed product, gated or not, prepares x: the gated ones under
    ``GMLX_PREPARED=1``, any under ``all``. Why the gated alone by default: on an H100
    (12-07, ncu's GPU time) x prepared took the 8B's gate-up-swiglu at 4x4 from 43.8 to
    39.0 us, but the q-k-v (384 blocks at 4x4, too few to spread each block's prologue
    over) from 12.0 to 15.1 at 4x4 and from 14.5 to 17.9 at 4x2, its two best shapes."""
    return os.environ.get(ENV, "0") == "all" or (gated and prepared())


def shared_bytes(k: int, warps: int) -> int:
    """A block's shared memory for a row of ``k`` values: x's floats, each chunk's sum and
    each warp's share of the squares' sum."""
    return 4 * k + 4 * (k // 32) + 4 * warps


def fits(k: int, warps: int) -> bool:
    """Whether a row of ``k`` values can be prepared in a block of ``warps`` warps."""
    return shared_bytes(k, warps) <= SHARED_BYTES


def source(layout: str, row_loads: str, row_sums: str, reduce_store: str) -> str:
    """The prepared source from the one-row source's parts: the layout's sizes, a chunk's
    loads of each row's codes, scale and bias (into ``q``, ``s``, ``b`` at chunk ``c``),
    each row's sums of a chunk (against ``xf`` and ``xs``), and the lanes' meeting and
    store (each as :mod:`qgemv_source` has them)."""
    sums = row_sums.replace("sd[di]", "s").replace("bd[di]", "b")
    return layout + r"""
    const int n0 = (blockIdx.x * WARPS + warp) * OUTS;
    __shared__ __align__(16) float4 xsh[8][XCHUNKS];  // chunk c's floats 4v..4v+3 at [v][c]: a warp's lanes read one row
    __shared__ float xsum[XCHUNKS];
    __shared__ float wss[WARPS];
    // this warp's first chunk (past the end: read, never written), before x is prepared
    uint32_t q[RPW][BITS];
    float s[RPW], b[RPW];
    {
        const int c = min(lane, chunks - 1);
""" + row_loads + r"""    }
    // the hidden state's squares' sum, each thread its chunks, met by the block
    float ss = 0.0f;
    for (int i = threadIdx.x; i < chunks; i += 32 * WARPS) {
        const uint4* hp = reinterpret_cast<const uint4*>(x + (size_t)i * 32);
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
            const uint4 raw = hp[v];
            const T* e = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float f = static_cast<float>(e[j]);
                ss += f * f;
            }
        }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) wss[warp] = ss;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int i = 0; i < WARPS; ++i) total += wss[i];
    const float scale = rsqrtf(total / (float)K + EPS);
    // x's floats (h * nw, then the norm's scale) and each chunk's sum, once for the block
    for (int i = threadIdx.x; i < chunks; i += 32 * WARPS) {
        const uint4* hp = reinterpret_cast<const uint4*>(x + (size_t)i * 32);
        const uint4* gp = reinterpret_cast<const uint4*>(nw + (size_t)i * 32);
        float part = 0.0f;
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
            const uint4 hr = hp[v], gr = gp[v];
            const T* e = reinterpret_cast<const T*>(&hr);
            const T* g = reinterpret_cast<const T*>(&gr);
            float f[8];
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                f[j] = static_cast<float>(e[j]) * static_cast<float>(g[j]) * scale;
                part += f[j];
            }
            xsh[2 * v][i] = float4{f[0], f[1], f[2], f[3]};
            xsh[2 * v + 1][i] = float4{f[4], f[5], f[6], f[7]};
        }
        xsum[i] = part;
    }
    __syncthreads();
""" + chunk_loop(row_loads, r"""        float xf[32];
        #pragma unroll
        for (int v = 0; v < 8; ++v) {
            const float4 t = xsh[v][c0];
            xf[4 * v] = t.x; xf[4 * v + 1] = t.y; xf[4 * v + 2] = t.z; xf[4 * v + 3] = t.w;
        }
        const float xs = xsum[c0];
""" + sums) + reduce_store


def chunk_loop(row_loads: str, body: str) -> str:
    """The prepared sources' loop over a lane's chunks (after the block has made x and met
    at its barrier): warps past the last row leave, then each chunk's ``body`` (its sums
    into ``acc``, from ``q``, ``s`` and ``b``) runs while the next chunk's weights are in
    flight, loaded by ``row_loads`` into ``qn``, ``sn`` and ``bn``; unrolled twice, so the
    copy from one to the other is the registers' renaming."""
    return r"""    if (n0 >= N) return;
    float acc[RPW];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
    #pragma unroll 2
    for (int c0 = lane; c0 < chunks; c0 += 32) {
        // the next chunk's weights in flight while this one is summed
        uint32_t qn[RPW][BITS];
        float sn[RPW], bn[RPW];
        if (c0 + 32 < chunks) {
            const int c = c0 + 32;
            uint32_t (&q)[RPW][BITS] = qn;
            float (&s)[RPW] = sn;
            float (&b)[RPW] = bn;
""" + row_loads + r"""        }
""" + body + r"""        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            #pragma unroll
            for (int i = 0; i < BITS; ++i) q[r][i] = qn[r][i];
            s[r] = sn[r];
            b[r] = bn[r];
        }
    }
"""
