"""The one-row source with each row's K split between warps of a block (``GMLX_SPLIT_K``, on by default):
the transforms :mod:`qgemv_source` applies to its one-row source, normed or not, for
:data:`qgemv_source.SPLIT_BODY` and :data:`qgemv_source.SPLIT_NORMED_BODY` (:func:`split`),
and to the source with x rounded to bytes once a block (:mod:`qgemv_q8`), for
:data:`qgemv_source.Q8_SPLIT_BODIES` (:func:`split_rounded`)."""

from __future__ import annotations

import os

ENV = "GMLX_SPLIT_K"  # 0: the one-row tuners leave the split shapes out


def splitting() -> bool:
    """Whether the split shapes are timed (on unless ``GMLX_SPLIT_K=0``). Measured with
    more chunks a lane in flight and the 6-bit products rounded (``gmlx-inflight``, H100,
    12-07, the synthetic 8B's served step in process): its 6-bit down products took 8x4
    split two ways, 22.2 us against 25.7; the whole step 2.85 ms against 3.13."""
    return os.environ.get(ENV, "1") != "0"

# The one-row source with each row's K split between ``SPLIT`` warps of the block
# (``SPLIT_BODY``): a block's WARPS / SPLIT groups of warps each take RPW weight rows, and
# warp ``sub`` of a group takes every SPLIT-th run of DEPTH chunks a lane; the warps' sums
# meet in shared memory and the group's first warp writes them. Why: a product of 4,096
# outputs at one row is 256-1,024 warps, 2-8 a streaming multiprocessor of an H200, each
# lane walking its chunks one after another (14 at K = 14,336): on the H200 (12-06 night)
# the 14,336-wide down products read at 1.4-1.8 TB/s and the o-projection at 1.5, where
# the 128,256-row output layer (8,000 blocks) read at 3.5. Split four ways, such a product
# is four times the warps, each lane a quarter of the chunks (one at K = 4,096). No warp
# leaves early (its rows past the end are read, never written): the block meets at one
# barrier.
_SPLIT_SUMS = r"""    {
        __shared__ float split_sums[WARPS][RPW + 1];
        if (lane == 0) {
            #pragma unroll
            for (int r = 0; r < RPW; ++r) split_sums[warp][r] = red[r];
            split_sums[warp][RPW] = SQUARES;
        }
        __syncthreads();
        #pragma unroll
        for (int r = 0; r <= RPW; ++r) {
            float v = 0.0f;
            #pragma unroll
            for (int s = 0; s < SPLIT; ++s) v += split_sums[warp - sub + s][r];
            if (r < RPW) red[r] = v; else SQUARES_TOTAL;
        }
    }
"""

# a block's groups of SPLIT warps, each group's rows, and a warp's place in its group
_GROUPS = ("    const int n0 = (blockIdx.x * (WARPS / SPLIT) + warp / SPLIT) * OUTS;\n"
           "    const int sub = warp % SPLIT;\n")
# the warps' sums met after each warp's lanes met (no squares to meet: a plain product's)
_MEET = ("        red[r] = v;\n    }\n", "        red[r] = v;\n    }\n"
         + _SPLIT_SUMS.replace("SQUARES_TOTAL", "(void)v").replace("SQUARES", "0.0f"))
# a group's first warp writes its rows
_WRITER = ("if (lane == r && n0 + r < N)", "if (lane == r && sub == 0 && n0 + r < N)")


def split(source: str) -> str:
    """The one-row source ``source`` with K split between warps (see ``_SPLIT_SUMS``); a
    source with the norm folded in (``_normed``) meets its squares' sums too, each warp's
    after its shuffles, before the scale is taken."""
    scale = "    const float scale = rsqrtf(ss / (float)K + EPS);\n"
    if scale in source:
        sums = _SPLIT_SUMS.replace("SQUARES_TOTAL", "ss = v").replace("SQUARES", "ss")
        meet = (scale, sums + scale)
    else:
        meet = _MEET
    steps = [("    const int n0 = (blockIdx.x * WARPS + warp) * OUTS;\n    if (n0 >= N) return;\n", _GROUPS),
             ("    for (int c0 = lane; c0 < chunks; c0 += 32 * DEPTH) {\n",
              "    for (int c0 = lane + 32 * DEPTH * sub; c0 < chunks; c0 += 32 * DEPTH * SPLIT) {\n"),
             meet, _WRITER]
    return _applied(source, steps)


def split_rounded(source: str) -> str:
    """The source with x rounded to bytes once a block (:func:`qgemv_q8.source`, a chunk a
    lane in flight, the norm folded in or not) with K split between warps (see
    ``_SPLIT_SUMS``). Why it may pay there more than in the float sums: every block rounds
    the whole row of x before its warps sum (an 8B's down product: 448 chunks of x for 16
    weight rows a block at 4x4, ~3.5 a thread, each a wait on x and ~150 instructions),
    so more warps a block share that prologue, and each walks 1/SPLIT of the row after it
    (7 chunks a lane at K = 14,336 split two ways, not 14). Each warp's first chunk is
    its own (``lane + 32 * sub``), loaded before x is rounded. A folded norm needs no
    meeting of its own (the block rounds and squares all of x together): the warps' sums
    meet before its scale, which follows the same line."""
    steps = [("    const int n0 = (blockIdx.x * WARPS + warp) * OUTS;\n", _GROUPS),
             ("        const int c = min(lane, chunks - 1);\n", "        const int c = min(lane + 32 * sub, chunks - 1);\n"),
             ("    if (n0 >= N) return;\n", ""),  # every warp meets at the sums' barrier
             ("    for (int c0 = lane; c0 < chunks; c0 += 32) {\n",
              "    for (int c0 = lane + 32 * sub; c0 < chunks; c0 += 32 * SPLIT) {\n"),
             ("        if (c0 + 32 < chunks) {\n            const int c = c0 + 32;\n",
              "        if (c0 + 32 * SPLIT < chunks) {\n            const int c = c0 + 32 * SPLIT;\n"),
             _MEET, _WRITER]
    return _applied(source, steps)


def _applied(source: str, steps: list[tuple[str, str]]) -> str:
    """``source`` with each (old, new) of ``steps`` replaced, each ``old`` there once."""
    for old, new in steps:
        if source.count(old) != 1:
            raise AssertionError(f"the one-row source changed: {old.strip()!r} is not there once")
        source = source.replace(old, new)
    return source
