"""The in-place one-token attention's step with the layer's rope folded in
(:mod:`cached_attention_source` assembles a kernel's body from these and its other
parts): the step's own queries and key rotated for each stream's position, through
shared memory by the block (:data:`STEP_ROPE`) or in each lane's registers
(:data:`STEP_ROPE_LANES`), both from one source of the arithmetic (:data:`ROPE_MATH`).
Each defines what the loops read: ``q_at``/``k_at`` (any element) and ``q_lane``/``k_lane``
(a lane's own VEC elements)."""

from __future__ import annotations

# The same, rotated for the stream's position by the layer's rope, folded in here (one
# operation a layer fewer: two of MLX's ropes or rope_cuda's kernel): angle ``rope_off[b]
# * rope_inv[i]`` for pair ``i``, the pairs ``(i, i + D/2)`` or, where ``TRAD``, ``(2i, 2i +
# 1)``, in float32 and rounded to ``T`` as MLX's rope rounds its output (the same
# arithmetic as :mod:`rope_cuda`'s). The block's threads rotate its queries and the key
# once, into shared memory, in a loop not unrolled (one ``sincosf`` in the code: a
# kernel's code is fetched at its launch, and each inlined ``sincosf`` is long). Both
# forms of the rope share its arithmetic (:data:`ROPE_MATH`: an element's angle and its
# rotation).
ROPE_MATH = """
const float rope_p = static_cast<float>(rope_off[b * rope_off_strides[0]]);
auto rope_angle = [&](int e, float& sn, float& cs) {  // element e's angle: its pair's
    const bool first = TRAD ? (e & 1) == 0 : e < D / 2;
    sincosf(rope_p * rope_inv[TRAD ? e >> 1 : (first ? e : e - D / 2)], &sn, &cs);
};
auto rotate = [&](const T* x, int64_t step, int e, float cs, float sn) -> T {  // element e of x, rotated
    const bool first = TRAD ? (e & 1) == 0 : e < D / 2;
    const int o = TRAD ? (e ^ 1) : (first ? e + D / 2 : e - D / 2);
    const float a = static_cast<float>(x[e * step]);
    const float other = static_cast<float>(x[o * step]);
    return static_cast<T>(first ? a * cs - other * sn : other * sn + a * cs);
};
"""
STEP_ROPE = ROPE_MATH + """
__shared__ float rope_q[GROUP][D];
__shared__ T rope_k[D];
{
    #pragma unroll 1
    for (int i = t; i < (GROUP + 1) * D; i += THREADS) {
        const int g = i / D;
        const int e = i % D;
        const T* x = g < GROUP ? q + b * q_strides[0] + (h0 + g) * q_strides[1] : kn;
        const int64_t step = g < GROUP ? q_strides[3] : k_new_strides[3];
        float sn, cs;
        rope_angle(e, sn, cs);
        const T r = rotate(x, step, e, cs, sn);
        if (g < GROUP) rope_q[g][e] = static_cast<float>(r); else rope_k[e] = r;
    }
    __syncthreads();
}
auto q_at = [&](int g, int e) -> float { return rope_q[g][e]; };
auto k_at = [&](int e) -> T { return rope_k[e]; };
auto q_lane = [&](int g, int e) -> float { return q_at(g, lane * VEC + e); };
auto k_lane = [&](int e) -> T { return k_at(lane * VEC + e); };
"""

# The same rotation for a key a warp without shared memory or a barrier (``GMLX_ROPE_LANES``):
# each lane rotates its own VEC dimensions of the group's queries and of the key (``q_lane``,
# ``k_lane``), their angles computed once, in registers; any other dimension of the key (the
# cache's write, ``k_at``) with its own angle. The same arithmetic, element for element. Why:
# folded in through shared memory, the rope cost the wide form ~4 us a call on the H100
# (12-07: 10.2 against 14.0 us at 38 keys), its block's loads of the keys waiting behind
# the rotation's loads, its sincosf and a barrier.
STEP_ROPE_LANES = ROPE_MATH + """
float rope_cs[VEC], rope_sn[VEC];
#pragma unroll
for (int e = 0; e < VEC; ++e) rope_angle(lane * VEC + e, rope_sn[e], rope_cs[e]);
auto q_lane = [&](int g, int e) -> float {
    return static_cast<float>(rotate(q + b * q_strides[0] + (h0 + g) * q_strides[1], q_strides[3], lane * VEC + e,
                                     rope_cs[e], rope_sn[e]));
};
T rope_k_own[VEC];  // (rotated here, so the angles' registers are free before the keys' loop)
#pragma unroll
for (int e = 0; e < VEC; ++e) rope_k_own[e] = rotate(kn, k_new_strides[3], lane * VEC + e, rope_cs[e], rope_sn[e]);
auto k_lane = [&](int e) -> T { return rope_k_own[e]; };
auto k_at = [&](int e) -> T {
    float sn, cs;
    rope_angle(e, sn, cs);
    return rotate(kn, k_new_strides[3], e, cs, sn);
};
"""
