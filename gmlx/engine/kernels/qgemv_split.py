"""The one-row source with each row's K split between warps of a block (``GMLX_SPLIT_K=1``):
the transform :mod:`qgemv_source` applies to its one-row source, normed or not, for
:data:`qgemv_source.SPLIT_BODY` and :data:`qgemv_source.SPLIT_NORMED_BODY`."""

from __future__ import annotations

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


def split(source: str) -> str:
    """The one-row source ``source`` with K split between warps (see ``_SPLIT_SUMS``); a
    source with the norm folded in (``_normed``) meets its squares' sums too, each warp's
    after its shuffles, before the scale is taken."""
    scale = "    const float scale = rsqrtf(ss / (float)K + EPS);\n"
    if scale in source:
        sums = _SPLIT_SUMS.replace("SQUARES_TOTAL", "ss = v").replace("SQUARES", "ss")
        meet = (scale, sums + scale)
    else:
        sums = _SPLIT_SUMS.replace("SQUARES_TOTAL", "(void)v").replace("SQUARES", "0.0f")
        meet = ("        red[r] = v;\n    }\n", "        red[r] = v;\n    }\n" + sums)
    steps = [("    const int n0 = (blockIdx.x * WARPS + warp) * OUTS;\n    if (n0 >= N) return;\n",
              ("    const int n0 = (blockIdx.x * (WARPS / SPLIT) + warp / SPLIT) * OUTS;\n"
               "    const int sub = warp % SPLIT;\n")),
             ("    for (int c0 = lane; c0 < chunks; c0 += 32 * DEPTH) {\n",
              "    for (int c0 = lane + 32 * DEPTH * sub; c0 < chunks; c0 += 32 * DEPTH * SPLIT) {\n"),
             meet,
             ("if (lane == r && n0 + r < N)", "if (lane == r && sub == 0 && n0 + r < N)")]
    for old, new in steps:
        if source.count(old) != 1:
            raise AssertionError(f"the one-row source changed: {old.strip()!r} is not there once")
        source = source.replace(old, new)
    return source
