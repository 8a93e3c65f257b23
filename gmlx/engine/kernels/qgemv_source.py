"""The CUDA sources of the one-to-eight-row quantized products (:mod:`qgemv_cuda` says
what they do, why, and what they measured): every source's common start (the layout's
sizes, a lane's place, its warp's weight rows), the one-row source (``DEPTH`` chunks a
lane in flight), the few-rows source (``MAXR`` rows of x), the one-row source with x
staged in shared memory (``TILES``), and those with the norm before the product folded
in, with K split between warps (:mod:`qgemv_split`) or with the weights streamed through
shared memory (:mod:`qgemv_async`). Each body is compiled after a head that says what a
product's rows are and where each is written (:mod:`qgemv_heads`) and the constants
:func:`qgemv_cuda._kernel` puts before it. The tests run these sources on the
CPU with CUDA's shuffles and bit instructions emulated."""

from __future__ import annotations

from gmlx.engine.kernels import qgemv_async, qgemv_prepared, qgemv_q8
from gmlx.engine.kernels.cuda_source import compact
from gmlx.engine.kernels.qgemv_split import split, split_rounded

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

# The one-row sources' share of chunk ``di`` (its x as ``xd[di]``): x's floats, then each
# row's sums (``_ROW_SUMS``); the norm transform (``_normed``) finds and replaces
# ``_CHUNK_X`` in each.
_CHUNK_X = _X_FLOATS.replace("XRAW", "xd[di]")

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
""" + _CHUNK_X + _ROW_SUMS + r"""        }
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

BODY = compact(_SOURCE)


# The one-row source with the RMSNorm before the product folded in (``NORMED_BODY``): the
# input is the block's hidden state ``h`` and the norm's weight ``nw`` (K values); each lane
# loads ``nw``'s 32 values of a chunk beside ``h``'s, keeps the sum of ``h``'s squares and
# takes ``h * nw`` in place of x; as a warp's lanes cover every chunk of the row, the warp
# meets the squares' sum by shuffles with its rows' sums and scales each by ``rsqrt(sum / K
# + EPS)`` before the output is written. The product is linear in x, so that is
# ``W (h * nw * rsqrt(mean(h^2) + eps))``: the norm and the product in one launch. MLX's
# norm rounds its output to T before the product reads it; here nothing is rounded
# until the output, so the result is nearer a float32 norm and product, not the same bits
# (the load holds it to MLX's distance from those). Why: on the H100 (12-06 evening) a
# one-stream step ran 65 norm kernels of ~3.2 us each, one a block before its MLP, and a
# served step's host hands over each kernel of a step.
_NORMED_X = r"""
        float xf[32];
        #pragma unroll
        for (int v = 0; v < 4; ++v) {
            const T* e = reinterpret_cast<const T*>(&xd[di][v]);
            const T* g = reinterpret_cast<const T*>(&nd[di][v]);
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float f = static_cast<float>(e[j]);
                ss += f * f;
                xf[8 * v + j] = f * static_cast<float>(g[j]);
            }
        }
        float xs = 0.0f;
        #pragma unroll
        for (int j = 0; j < 32; ++j) xs += xf[j];
"""
_NORMED_SCALE = r"""    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float scale = rsqrtf(ss / (float)K + EPS);
    #pragma unroll
    for (int r = 0; r < RPW; ++r) red[r] *= scale;
"""


def _normed(source: str) -> str:
    """The one-row source ``source`` with the norm folded in (see ``_NORMED_X``)."""
    steps = [("    float acc[RPW];\n", "    float acc[RPW];\n    float ss = 0.0f;\n"),
             ("        uint4 xd[DEPTH][4];\n", "        uint4 xd[DEPTH][4], nd[DEPTH][4];\n"),
             ("                for (int v = 0; v < 4; ++v) xd[di][v] = xp[v];\n",
              ("                for (int v = 0; v < 4; ++v) xd[di][v] = xp[v];\n"
               "                const uint4* np4 = reinterpret_cast<const uint4*>(nw + (size_t)c * 32);\n"
               "                #pragma unroll\n"
               "                for (int v = 0; v < 4; ++v) nd[di][v] = np4[v];\n")),
             (_CHUNK_X, _NORMED_X),
             ("        red[r] = v;\n    }\n", "        red[r] = v;\n    }\n" + _NORMED_SCALE)]
    for old, new in steps:
        if source.count(old) != 1:
            raise AssertionError(f"the one-row source changed: {old.strip()!r} is not there once")
        source = source.replace(old, new)
    return source


# The one-row source with each warp's weights streamed through shared memory
# (:mod:`qgemv_async`), with the norm folded in or not.
_ASYNC_SOURCE = qgemv_async.source(_START, _CHUNK_X, _ROW_SUMS, _REDUCE_STORE)
NORMED_BODY = compact(_normed(_SOURCE))
ASYNC_BODY = compact(_ASYNC_SOURCE)
ASYNC_NORMED_BODY = compact(_normed(_ASYNC_SOURCE))
# The one-row source with the norm folded in and x prepared once a block (:mod:`qgemv_prepared`).
PREPARED_BODY = compact(qgemv_prepared.source(_LAYOUT, _ROW_LOADS, _ROW_SUMS, _REDUCE_STORE))
# The one-row source with x rounded to bytes once a block (:mod:`qgemv_q8`), the norm
# folded in or not, by (normed, ``DEPTH`` chunks a lane in flight: ``GMLX_Q8_DEPTH=1``).
Q8_BODIES = {(normed, deep): compact(qgemv_q8.source(_LAYOUT, _ROW_LOADS, _REDUCE_STORE, normed, deep))
             for normed in (False, True) for deep in (False, True)}
# ... and with each row's K split between warps (``GMLX_SPLIT_K=1``), a chunk a lane in
# flight, by normed (:func:`qgemv_split.split_rounded`).
Q8_SPLIT_BODIES = {normed: compact(split_rounded(qgemv_q8.source(_LAYOUT, _ROW_LOADS, _REDUCE_STORE, normed)))
                   for normed in (False, True)}
SPLIT_BODY = compact(split(_SOURCE))
SPLIT_NORMED_BODY = compact(split(_normed(_SOURCE)))
ROWS_BODY = compact(_ROWS_SOURCE)
STAGED_BODY = compact(_STAGED_SOURCE)
