"""The one-row products' 4-bit sums in half-precision pairs (``GMLX_HALF2=1``, float16
models; off by default until a lease serves it): the CUDA snippets :mod:`qgemv_source`
puts in its row sums, taken where the kernel's head says ``HALF2`` and the layout is
4-bit (``H2``).

Why: a 4-bit product's sums cost ~5 instructions a code in float32 (a byte permute that
makes the code a float, the float multiply-add, the nibble masks, and the moves between
halves and floats: 640 PTX instructions a 4-row chunk of 128 codes of the normed gate-up
product, counted from its compiled source). At one stream the 8B's gate-up product is
117M codes a step, so ~18M warp instructions: ~17 us of an H200's issue slots (132
multiprocessors, 4 issues a clock, ~2 GHz) beside the ~15 us its bytes take at 4.8 TB/s.
The H200's products read at 0.3-1.8 TB/s (12-06 night) while the 6-bit output layer read
at 3.5 with its issue slots ~70% busy, so the products looked bound by their instructions.
Measured (12-07, H100, the 8B's Q4_K_M served): no faster. The gate-up-swiglu's best
shape timed 47.4 against 45.2 us a layer, and one stream served 269.0 against 277.3 tok/s.
The reason is in the machine code, not the memory: ptxas makes the float sums one byte
permute a code, so the half pairs' loop is as long in SASS (587 against 591 instructions
a 4-row chunk; ``benchmarks/gpu/sass_count.py``). The ~2x below is PTX's count. It stays
off. :mod:`qgemv_prepared` cuts the loop where the instructions are: x's side.

Here each 32-bit word of eight codes becomes four pairs of halves, ``4 + q / 256`` each (the
codes or-ed under 4's exponent: one shift and one logic operation a pair), less 4 (one
pair subtract, exact: ``q / 256``), and each pair is multiplied into a pair of sums
against the matching pair of x (one pair multiply-add): 15 instructions for eight codes
where the float sums take ~35. The pairs of x (values ``i`` and ``i + 4`` of each word,
one byte permute a pair) are made once a chunk and serve every weight row of the warp.
A pair of sums takes eight terms of at most ``15/256 |x|``: under 30,700 for any half x,
so no sum leaves half's range (the normed sources scale the norm's weight by 1/16 first,
so the hidden state times a norm weight up to 16 stays in it too). Half's rounding (11
bits) over eight terms is the error this costs, ~1e-3 of a chunk's sum at worst, before
the float32 sum of the chunks, the scale and the bias; a term under half's normal range
(|x| below ~1e-3) keeps an absolute error under 3e-8.
"""

from __future__ import annotations

import os

ENV = "GMLX_HALF2"


def half2() -> bool:
    """Whether a float16 model's 4-bit one-row products sum in half pairs (``GMLX_HALF2=1``)."""
    return os.environ.get(ENV, "0") == "1"


def constant(cuda_type: str, on: bool) -> str:
    """The ``HALF2`` constant of a kernel's head for a layout of CUDA type ``cuda_type``
    (``on``: :func:`half2` where the kernel was asked for)."""
    return f" constexpr bool HALF2 = {'true' if on and cuda_type == '__half' else 'false'};"


# x's pairs of a chunk (``xp[v][i]``: values 8v + i and 8v + i + 4, as a word's code i and
# code i + 4 sit in its low and high halves), from the four wide words ``XWORDS(v)``.
PAIRS = r"""            __half2 xp[4][4];
            if (H2) {
                #pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const uint4 m = XWORDS(v);
                    const uint32_t e[4] = {m.x, m.y, m.z, m.w};
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const uint32_t p = __byte_perm(e[i >> 1], e[(i >> 1) + 2], (i & 1) ? 0x7632u : 0x5410u);
                        xp[v][i] = *reinterpret_cast<const __half2*>(&p);
                    }
                }
            }
"""

# Row ``r``'s share of the chunk in half pairs (a word's codes i and i + 4 as ``q / 256``
# against ``xp[v][i]``, words 0-1 and 2-3 into two pairs of sums), the sum of the codes
# against x made float (times 256, or 4,096 where x was scaled by 1/16: ``H2_SCALE``),
# then the scale and bias.
ROW = r"""                if (H2) {
                    const uint32_t k4w = 0x44004400u;
                    const __half2 k4 = *reinterpret_cast<const __half2*>(&k4w);
                    __half2 hs[2] = {__float2half2_rn(0.0f), __float2half2_rn(0.0f)};
                    #pragma unroll
                    for (int v = 0; v < 4; ++v) {
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const uint32_t hb = ((q[r][v] >> (4 * i)) & 0x000F000Fu) | 0x44004400u;
                            hs[v >> 1] = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&hb), k4), xp[v][i], hs[v >> 1]);
                        }
                    }
                    const float2 f0 = __half22float2(hs[0]), f1 = __half22float2(hs[1]);
                    const float dot = H2_SCALE * ((f0.x + f0.y) + (f1.x + f1.y));
                    acc[r] += sd[di][r] * dot + bd[di][r] * xs;
                    continue;
                }
"""

# The normed sources' x: the hidden state's pairs times the norm weight's scaled by 1/16
# (each product rounded to half, as MLX's norm rounds its output before a product reads
# it; the 1/16 keeps a product of a large state and weight in half's range).
HMUL4 = r"""    auto gmlx_hmul4 = [](const uint4& a, const uint4& b) {
        const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
        const __half2 sixteenth = __float2half2_rn(0.0625f);
        uint4 m;
        uint32_t* mv = &m.x;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&av[i]),
                                      __hmul2(*reinterpret_cast<const __half2*>(&bv[i]), sixteenth));
            mv[i] = *reinterpret_cast<const uint32_t*>(&p);
        }
        return m;
    };
"""
