"""The one-row products with their weights streamed through shared memory (``GMLX_ASYNC=1``;
off by default until a lease serves it): the source, the launch shapes the tuners time,
and where a layout takes them.

Why: the 8B's per-layer products read at 0.3-1.8 TB/s of the H200's 4.8 (12-06 night)
and ~1.6 of the H100's 3.35, on both cards at about the same time a step, so part of
their time is waiting on the bytes a multiprocessor keeps in flight (their instructions
are the other part: :mod:`qgemv_prepared`). The one-row source keeps one chunk of each
of a warp's rows in registers at a time.
Deeper register forms (``DEPTH`` 2) hold two, but they take 150-170 registers a thread
against 96, so fewer warps fit and the bytes in flight stay about the same: the gate-up
took 49.2 us at depth 2 against 45.2 at depth 1.

Here each warp keeps ``STAGES`` rounds of its rows' chunks (a round: 32 chunks, one a
lane) in flight through shared memory with the GPU's asynchronous copies (``cp.async``,
sm_80 on). The codes take 16 bytes a lane a row for 4-bit, and the scales and biases of
the round are 16-byte copies by the first lanes. The registers hold one chunk at a time,
as at depth 1. A round's copies are one group; the warp waits for the oldest group, meets
at ``__syncwarp`` (a lane reads the scales another copied), loads x's values of its chunk
(from L1: every warp reads the same x), sums that round as the one-row source does, and
meets again before the round after next overwrites the slot. Loading x before the wait
would overlap its latency, but x's raw words (and the norm weight's) would then live
across the wait: the gate-up at 4x2 with 4 rounds took 121 registers a thread that way
against 72 (sm_90, ptxas), 4 blocks a multiprocessor against 7.
Where the source runs on the host (the tests' emulation), a copy is a plain copy.
Measured in process (12-07, H100, ncu's GPU time): the normed gate-up-swiglu at 4x4 with
2 rounds took 37.0 us against 43.8 for the default shape; at 4x2 with 4 rounds, 51.3.
"""

from __future__ import annotations

import os

ENV = "GMLX_ASYNC"
SHARED_BYTES = 48 * 1024  # a block's static shared memory at most

# one row: (warps, rows a warp, 1, 1, 0, 1, rounds in flight): every shape at most 32 row-rounds
# a block, so an 8-bit layout of groups of 32 fits 48 KB too
ASYNC = [(4, 2, 1, 1, 0, 1, 4), (4, 4, 1, 1, 0, 1, 2), (8, 2, 1, 1, 0, 1, 2), (2, 4, 1, 1, 0, 1, 4)]


def streaming() -> bool:
    """Whether the tuners time the streamed shapes (``GMLX_ASYNC=1``)."""
    return os.environ.get(ENV, "0") == "1"


def shared_bytes(warps: int, rpw: int, stages: int, bits: int, group_size: int) -> int:
    """A block's shared memory at this shape and layout: the codes of each row-round (32
    chunks of 32 codes) and its scales and biases."""
    return stages * warps * rpw * (128 * bits + 2 * 2048 // group_size)


def fits(k: int, group_size: int) -> bool:
    """Whether a row of ``k`` values in groups of ``group_size`` can be streamed: its
    scales' rows start on 16 bytes (groups a row a multiple of 8) and a round's scales
    are whole 16-byte copies (groups of at most 128)."""
    return (k // group_size) % 8 == 0 and group_size <= 128


def shapes(k: int) -> list[tuple[int, ...]]:
    """The streamed shapes a one-row product of ``k`` values is timed in beside the others
    (where :func:`streaming`): a row of at least one round (1,024 values)."""
    return list(ASYNC) if streaming() and k >= 1024 else []


# The copies: on the device the asynchronous ones (16 bytes, or 8 for the 6-bit codes'
# 24, ``valid`` of them read and the rest zero-filled), their groups and waits; on the host
# a plain copy.
COPIES = r"""
#ifndef GMLX_CP16
#ifdef __CUDA_ARCH__
#define GMLX_SMEM(p) ([](const void* q) { unsigned a; asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(q)); return a; }(p))
#define GMLX_CP16(dst, src, valid) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(GMLX_SMEM(dst)), "l"(src), "r"(valid) : "memory")
#define GMLX_CP8(dst, src, valid) asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" :: "r"(GMLX_SMEM(dst)), "l"(src), "r"(valid) : "memory")
#define GMLX_COMMIT() asm volatile("cp.async.commit_group;\n" ::: "memory")
#define GMLX_WAIT(n) asm volatile("cp.async.wait_group %0;\n" :: "n"(n) : "memory")
#else
#define GMLX_CP16(dst, src, valid) gmlx_host_copy(dst, src, 16, valid)
#define GMLX_CP8(dst, src, valid) gmlx_host_copy(dst, src, 8, valid)
#define GMLX_COMMIT()
#define GMLX_WAIT(n)
#endif
#endif
"""


def source(start: str, x_floats: str, row_sums: str, reduce_store: str) -> str:
    """The streamed one-row source from the one-row source's parts: its common start,
    x's floats, the rows' sums of a chunk and the lanes' meeting and store (each as
    :mod:`qgemv_source` has them, so its norm transform applies here as there)."""
    return start + COPIES + r"""
    constexpr int SPR = 2048 / G;  // bytes of a round's scales (and of its biases) a row
    __shared__ __align__(16) uint32_t wst[STAGES][WARPS][RPW][32 * BITS];
    __shared__ __align__(16) T sst[STAGES][WARPS][RPW][SPR / 2];
    __shared__ __align__(16) T bst[STAGES][WARPS][RPW][SPR / 2];
    const int rounds = (chunks + 31) / 32;
    // round ``it``'s codes of each row (a lane its chunk) and its scales and biases (the
    // first 2 * SPR / 16 lanes, 16 bytes each) into slot ``slot``; past the row's end, none
    auto issue = [&](int slot, int it) {
        const int c = it * 32 + lane;
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int n = min(n0 + r % OUTS, N - 1);  // past the end: read, never written
            const uint32_t* p = ROW_W(r, n) + (size_t)min(c, chunks - 1) * BITS;
            uint32_t* d = &wst[slot][warp][r][lane * BITS];
            if (BITS == 6) {
                #pragma unroll
                for (int v = 0; v < 3; ++v) GMLX_CP8(d + 2 * v, p + 2 * v, c < chunks ? 8 : 0);
            } else {
                #pragma unroll
                for (int v = 0; v < BITS / 4; ++v) GMLX_CP16(d + 4 * v, p + 4 * v, c < chunks ? 16 : 0);
            }
            if (lane < 2 * (SPR / 16)) {
                const bool bias = lane >= SPR / 16;
                const int part = lane % (SPR / 16);
                const int g0 = it * (SPR / 2) + part * 8;  // the first of the 8 groups this lane copies
                const int valid = max(0, min(8, groups - g0)) * 2;
                const T* src = (bias ? ROW_B(r, n) : ROW_S(r, n)) + (valid ? g0 : 0);
                T* dst = bias ? &bst[slot][warp][r][part * 8] : &sst[slot][warp][r][part * 8];
                GMLX_CP16(dst, src, valid);
            }
        }
    };
    float acc[RPW];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
    #pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < rounds) issue(st, st);
        GMLX_COMMIT();
    }
    for (int it = 0; it < rounds; ++it) {
        if (it + STAGES - 1 < rounds) issue((it + STAGES - 1) % STAGES, it + STAGES - 1);
        GMLX_COMMIT();
        constexpr int di = 0;
        const int c = it * 32 + lane;
        GMLX_WAIT(STAGES - 1);  // round it's group is in
        __syncwarp();
        uint4 xd[DEPTH][4];
        if (c < chunks) {
            {  // (the one-row source's x loads, line for line: the norm transform extends them)
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)c * 32);
                #pragma unroll
                for (int v = 0; v < 4; ++v) xd[di][v] = xp[v];
            }
            const int slot = it % STAGES;
            uint32_t qd[DEPTH][RPW][BITS];
            float sd[DEPTH][RPW], bd[DEPTH][RPW];
            #pragma unroll
            for (int r = 0; r < RPW; ++r) {
                const uint32_t* w_ = &wst[slot][warp][r][lane * BITS];  // wide reads: no bank conflicts
                if (BITS == 6) {
                    #pragma unroll
                    for (int v = 0; v < 3; ++v) {
                        const uint2 u = reinterpret_cast<const uint2*>(w_)[v];
                        qd[di][r][2 * v] = u.x; qd[di][r][2 * v + 1] = u.y;
                    }
                } else {
                    #pragma unroll
                    for (int v = 0; v < BITS / 4; ++v) {
                        const uint4 u = reinterpret_cast<const uint4*>(w_)[v];
                        qd[di][r][4 * v] = u.x; qd[di][r][4 * v + 1] = u.y; qd[di][r][4 * v + 2] = u.z; qd[di][r][4 * v + 3] = u.w;
                    }
                }
                sd[di][r] = static_cast<float>(sst[slot][warp][r][lane * 32 / G]);
                bd[di][r] = static_cast<float>(bst[slot][warp][r][lane * 32 / G]);
            }
            uint32_t (&q)[RPW][BITS] = qd[di];
""" + x_floats + row_sums + r"""        }
        __syncwarp();  // every lane done with the slot before round it + STAGES is copied in
    }
""" + reduce_store
