"""The CUDA sources of the in-place one-token attention (:mod:`cached_attention_cuda`
says what it does, why, and what it measured): both layouts' common start, the step's
own query and key as the projections made them or rotated by the layer's rope folded in
(:data:`STEP`; rotated: :mod:`cached_attention_rope`), a key a warp or a key a lane (:func:`body`), and how a
block ends, whole or split (:data:`FINISH_ONE`, :data:`FINISH_SPLIT`). Each is compiled with the constants
:func:`cached_attention_cuda._kernel` puts before it (the float type, head size, block
size, scale, the group of query heads a block and the head split). The tests run these
sources on the CPU, each block as host threads."""

from __future__ import annotations

from gmlx.engine.kernels.cached_attention_rope import STEP_ROPE, STEP_ROPE_LANES
from gmlx.engine.kernels.cuda_source import compact

# Both layouts' start: a block a (stream, key-value head, part of its group, split), its
# GROUP query heads from ``h0`` (the key-value head's GROUP * HSPLIT split in HSPLIT parts)
# and its share of the keys (``start`` to ``end``), the cache's rows of this head, the
# warps' shares in shared memory, and ``row``: this lane's VEC dimensions of a row in one
# wide load; where the build is for dense rows alone (``DENSE``: each row's dimensions
# adjacent and rows 16-byte aligned, as gmlx's caches hold them), no strided path is
# compiled (less code for a launch to fetch), and a strided cache gets NaN, not a wrong answer.
COMMON = """
constexpr int WARPS = THREADS / 32;
constexpr int VEC = D / 32;
__shared__ float wm[WARPS][GROUP];
__shared__ float wl[WARPS][GROUP];
__shared__ float wacc[WARPS][GROUP][D];
const int t = threadIdx.x;
const int lane = t & 31;
const int warp = t >> 5;
const int heads = q_shape[1];
const int kv_heads = k_shape[1];
const int splits = gridDim.x / (q_shape[0] * kv_heads * HSPLIT);
const int split = blockIdx.x % splits;
const int sub = blockIdx.x / splits % HSPLIT;
const int kvh = blockIdx.x / splits / HSPLIT % kv_heads;
const int b = blockIdx.x / splits / HSPLIT / kv_heads;
const int h0 = (kvh * HSPLIT + sub) * GROUP;  // the block's first query head
const int at = position[0];
const int first = padding[b * padding_strides[0]];
const int span = max(0, (at + 1 - first + splits - 1) / splits);
const int start = first + split * span;
const int end = min(at + 1, start + span);
T* kb = const_cast<T*>(k) + b * k_strides[0] + kvh * k_strides[1];
T* vb = const_cast<T*>(v) + b * v_strides[0] + kvh * v_strides[1];
const T* kn = k_new + b * k_new_strides[0] + kvh * k_new_strides[1];
const T* vn = v_new + b * v_new_strides[0] + kvh * v_new_strides[1];
const bool krows = k_strides[3] == 1 && k_strides[2] % 8 == 0;
const bool vrows = v_strides[3] == 1 && v_strides[2] % 8 == 0;
const bool kdense = DENSE || krows;
const bool vdense = DENSE || vrows;
if (DENSE && !(krows && vrows)) {
    // a build for dense rows handed a strided cache: every output NaN (loud), nothing written
    for (int i = t; i < GROUP * D; i += THREADS) {
        const int g = i / D;
        const int d = i % D;
        const int h = h0 + g;
        const float top = 0.0f;
        const float total = 1.0f;
        FINISH(__uint_as_float(0x7fc00000u));
    }
    return;
}
// this lane's VEC dimensions of a row (dense: one load of 4, 8 or 16 bytes), as floats
auto row = [&](float* dst, const T* r, int64_t step, bool dense) {
    if (dense) {
        if constexpr (VEC == 2) {
            const uint32_t raw = *reinterpret_cast<const uint32_t*>(r + lane * VEC);
            const T* x = reinterpret_cast<const T*>(&raw);
            for (int e = 0; e < VEC; ++e) dst[e] = static_cast<float>(x[e]);
        } else if constexpr (VEC == 4) {
            const uint2 raw = *reinterpret_cast<const uint2*>(r + lane * VEC);
            const T* x = reinterpret_cast<const T*>(&raw);
            for (int e = 0; e < VEC; ++e) dst[e] = static_cast<float>(x[e]);
        } else {
            const uint4 raw = *reinterpret_cast<const uint4*>(r + lane * VEC);
            const T* x = reinterpret_cast<const T*>(&raw);
            for (int e = 0; e < VEC; ++e) dst[e] = static_cast<float>(x[e]);
        }
    } else {
        for (int e = 0; e < VEC; ++e) dst[e] = static_cast<float>(r[(lane * VEC + e) * step]);
    }
};
"""

# The step's own elements, each as the block needs it: element ``e`` of query head ``h0 +
# g`` as a float (``q_at``) and of the step's key (``k_at``), as the projections made them.
STEP = """
auto q_at = [&](int g, int e) -> float {
    return static_cast<float>(q[b * q_strides[0] + (h0 + g) * q_strides[1] + e * q_strides[3]]);
};
auto k_at = [&](int e) -> T { return kn[e * k_new_strides[3]]; };
auto q_lane = [&](int g, int e) -> float { return q_at(g, lane * VEC + e); };
auto k_lane = [&](int e) -> T { return k_at(lane * VEC + e); };
"""

# A key a warp (the served form since 12-05): the WARPS warps take the split's keys in
# turn, each lane VEC dimensions of the key and of its values. The warp's lanes hold the
# query of every head of the group, so each key and value is read once for all of them; a
# key's score per head is the lanes' dot products summed by shuffles, and each warp keeps
# its own running maximum, total and values per head (no barrier until the end). UNROLL
# keys' loads go out before their use (the kernel's head sets it: :func:`unroll`).
WARP_LOOP = """
float qv[GROUP][VEC];
float m[GROUP], l[GROUP], acc[GROUP][VEC];
#pragma unroll
for (int g = 0; g < GROUP; ++g) {
    #pragma unroll
    for (int e = 0; e < VEC; ++e) {
        qv[g][e] = q_lane(g, e) * QSCALE;
        acc[g][e] = 0.0f;
    }
    m[g] = FLOOR;
    l[g] = 0.0f;
}
for (int j0 = start + warp; j0 < end; j0 += WARPS * UNROLL) {
    float kf[UNROLL][VEC], vf[UNROLL][VEC];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int j = j0 + u * WARPS;
        if (j == at) {  // the step's own key and value, from their arrays
            #pragma unroll
            for (int e = 0; e < VEC; ++e) kf[u][e] = static_cast<float>(k_lane(e));
            row(vf[u], vn, v_new_strides[3], false);
        } else if (j < end) {
            row(kf[u], kb + (int64_t)j * k_strides[2], k_strides[3], kdense);
            row(vf[u], vb + (int64_t)j * v_strides[2], v_strides[3], vdense);
        }
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        if (j0 + u * WARPS >= end) break;
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s = 0.0f;
            #pragma unroll
            for (int e = 0; e < VEC; ++e) s += qv[g][e] * kf[u][e];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            const float mn = fmaxf(m[g], s);
            const float corr = exp2f(m[g] - mn);
            const float p = exp2f(s - mn);
            l[g] = l[g] * corr + p;
            #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] = acc[g][e] * corr + p * vf[u][e];
            m[g] = mn;
        }
    }
}
"""

# The warps' shares meet in shared memory, a thread an output (head, dimension); one block
# of each key-value head (its first split of its first part) writes the step's key and
# value into the cache.
MERGE = """
#pragma unroll
for (int g = 0; g < GROUP; ++g) {
    #pragma unroll
    for (int e = 0; e < VEC; ++e) wacc[warp][g][lane * VEC + e] = acc[g][e];
    if (lane == 0) { wm[warp][g] = m[g]; wl[warp][g] = l[g]; }
}
__syncthreads();
for (int i = t; i < GROUP * D; i += THREADS) {
    const int g = i / D;
    const int d = i % D;
    float top = FLOOR;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, wm[w][g]);
    float total = 0.0f;
    float r = 0.0f;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float wt = exp2f(wm[w][g] - top);
        total += wl[w][g] * wt;
        r += wacc[w][g][d] * wt;
    }
    const int h = h0 + g;
    FINISH(r);
}
if (split == 0 && sub == 0 && t < D) {
    kb[(int64_t)at * k_strides[2] + t * k_strides[3]] = k_at(t);
    vb[(int64_t)at * v_strides[2] + t * v_strides[3]] = vn[t * v_new_strides[3]];
}
"""



# The same attention a key a lane: a warp takes the split's keys 32 at a time, each lane
# one key's scores for every head of the group (its whole key against the group's
# queries, held scaled in shared memory and read by all lanes at once), so a tile's
# maximum is one shuffle reduction a head and each lane's weight one exp2f; the weights go
# through shared memory and the warp adds the tile's values a key at a time, each lane
# VEC dimensions (as above), UNROLL keys' loads in flight (a tile's values: rows whose raw
# words are held; the head sets it: :func:`unroll`). Each lane keeps its share of
# the total, summed over the warp at the end. Per key the form above shuffles five times
# and takes two exp2f a head on every lane; this one takes about 5/32 and 2/32.
LANE_LOOP = """
__shared__ float qs[GROUP][D];
__shared__ float ps[WARPS][32][GROUP];
alignas(16) __shared__ T own_k[D];  // the step's own key and value, dense, for the wide loads
alignas(16) __shared__ T own_v[D];
// eight dimensions of a row from c on (dense: one 16-byte load), as floats
auto eight = [&](float* dst, const T* r, int c, int64_t step, bool dense) {
    if (dense) {
        const uint4 raw = *reinterpret_cast<const uint4*>(r + c);
        const T* x = reinterpret_cast<const T*>(&raw);
        for (int e = 0; e < 8; ++e) dst[e] = static_cast<float>(x[e]);
    } else {
        for (int e = 0; e < 8; ++e) dst[e] = static_cast<float>(r[(c + e) * step]);
    }
};
for (int i = t; i < GROUP * D; i += THREADS) {
    const int g = i / D;
    const int e = i % D;
    qs[g][e] = q_at(g, e) * QSCALE;
}
if (t < D) {
    own_k[t] = k_at(t);
    own_v[t] = vn[t * v_new_strides[3]];
}
__syncthreads();
float m[GROUP], l[GROUP], acc[GROUP][VEC];
#pragma unroll
for (int g = 0; g < GROUP; ++g) {
    m[g] = FLOOR;
    l[g] = 0.0f;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) acc[g][e] = 0.0f;
}
for (int j0 = start + warp * 32; j0 < end; j0 += WARPS * 32) {
    const int j = j0 + lane;
    const bool live = j < end;
    float s[GROUP];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) s[g] = 0.0f;
    if (live) {
        const bool own = j == at;
        const T* kr = own ? own_k : kb + (int64_t)j * k_strides[2];
        const int64_t step = own ? 1 : k_strides[3];
        const bool dense = own || kdense;
        #pragma unroll
        for (int c = 0; c < D; c += 8) {
            float kf[8];
            eight(kf, kr, c, step, dense);
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                #pragma unroll
                for (int e = 0; e < 8; ++e) s[g] += qs[g][c + e] * kf[e];
            }
        }
    }
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float top = live ? s[g] : FLOOR;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        const float mn = fmaxf(m[g], top);
        const float corr = exp2f(m[g] - mn);
        const float p = live ? exp2f(s[g] - mn) : 0.0f;
        l[g] = l[g] * corr + p;
        #pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] *= corr;
        m[g] = mn;
        ps[warp][lane][g] = p;
    }
    __syncwarp();
    const int n = min(32, end - j0);
    for (int u0 = 0; u0 < n; u0 += UNROLL) {
        // UNROLL rows' raw words (this lane's VEC dimensions of each) loaded before any use
        uint32_t raw[UNROLL][VEC / 2];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int jj = j0 + u0 + u;
            if (u0 + u >= n) break;
            const T* r = (jj == at ? own_v : vb + (int64_t)jj * v_strides[2]) + lane * VEC;
            if (jj != at && !vdense) {  // a strided cache: a dimension at a time
                for (int e = 0; e < VEC; ++e)
                    reinterpret_cast<T*>(raw[u])[e] = vb[(int64_t)jj * v_strides[2] + (lane * VEC + e) * v_strides[3]];
            } else if constexpr (VEC == 2) {
                raw[u][0] = *reinterpret_cast<const uint32_t*>(r);
            } else if constexpr (VEC == 4) {
                const uint2 w = *reinterpret_cast<const uint2*>(r);
                raw[u][0] = w.x; raw[u][1] = w.y;
            } else {
                const uint4 w = *reinterpret_cast<const uint4*>(r);
                raw[u][0] = w.x; raw[u][1] = w.y; raw[u][2] = w.z; raw[u][3] = w.w;
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (u0 + u >= n) break;
            const T* x = reinterpret_cast<const T*>(raw[u]);
            float vf[VEC];
            #pragma unroll
            for (int e = 0; e < VEC; ++e) vf[e] = static_cast<float>(x[e]);
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float p = ps[warp][u0 + u][g];
                #pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][e] += p * vf[e];
            }
        }
    }
    __syncwarp();
}
#pragma unroll
for (int g = 0; g < GROUP; ++g) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) l[g] += __shfl_xor_sync(0xffffffffu, l[g], o);
}
"""



def unroll(layout: str, d: int, given: int = 0) -> int:
    """Keys whose loads a warp has in flight at once: ``given``, else the layout's own
    (a key a warp: 4, or 1 in the wide form's blocks of many warps, whose registers a
    thread are fewer; a key a lane: 16 rows of values, 8 for heads of 256). More keys
    in flight hide more of a load's wait and make the kernel's code longer (the key-a-
    warp loop for the 8B's heads: ~41 KB of SASS at 4, ~27 at 2, ~20 at 1, all of it
    fetched by an SM at a launch's first keys)."""
    return given or (1 if layout == "wide" else 4 if layout == "warp" else 8 if d // 32 == 8 else 16)


def body(layout: str, rope: bool = False, lanes: bool = False) -> str:
    """A kernel's body: a key a warp (``layout`` ``"warp"``) or a key a lane, the step's
    query and key rotated in it with ``rope`` (:data:`cached_attention_rope.STEP_ROPE`; a key
    a warp with ``lanes``, each lane its own dimensions: :data:`cached_attention_rope.STEP_ROPE_LANES`)."""
    if lanes and (layout == "lane" or not rope):
        raise ValueError("each lane rotates its own dimensions only where a key is a warp's and the rope folded in")
    step = (STEP_ROPE_LANES if lanes else STEP_ROPE) if rope else STEP
    return compact(COMMON + step + (LANE_LOOP if layout == "lane" else WARP_LOOP) + MERGE)

# How a block ends: with a head's keys in one block, the output of each head of its
# group (``out``, ``(B, 1, H * D)``); split, each head's share (the values' sum unscaled,
# the running maximum and total) at ``(stream, head, split)``, where
# :func:`attention_cuda.in_blocks`'s combine reads it.
FINISH_ONE = ("#define FINISH(r) out[((size_t)b * heads + h) * D + d] = "
               "static_cast<T>(total > 0.0f ? (r) / total : 0.0f)\n")
FINISH_SPLIT = ("#define FINISH(r) { const size_t at_ = ((size_t)b * heads + h) * splits + split; "
                 "pacc[at_ * D + d] = (r); if (d == 0) { pm[at_] = top; pl[at_] = total; } }\n")
