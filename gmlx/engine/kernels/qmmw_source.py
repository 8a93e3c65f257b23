"""The CUDA source of the tensor-core quantized product of a few to 64 rows
(:mod:`qmmw_cuda` says what it does, why, and what it measured): its body, the half-float
and tensor-core instructions it is written with (:data:`MACROS`), and the heads that say
what a product reads and where it writes: one layer, a gated pair (swiglu of gate and
up) or two or three layers read as one (:func:`parts_head`). The body is compiled with
the constants :func:`qmmw_cuda._kernel` puts before it. The tests run it on the CPU with
the tensor-core instructions emulated."""

from __future__ import annotations

from gmlx.engine.kernels.cuda_source import SWIGLU, compact

_SOURCE = r"""
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr bool PAIRED = BF == 0 || BITS < 8;   // a pair of codes as OFF + q exactly
    constexpr unsigned MAGIC = BF ? 0x43004300u : 0x64006400u;
    constexpr unsigned ONE2 = BF ? 0x3F803F80u : 0x3C003C00u;      // (1, 1)
    constexpr unsigned MINUS_OFF2 = BF ? 0xC300C300u : 0xE400E400u; // (-OFF, -OFF)
    const int K = w_shape[1] * 32 / BITS;
    int rows = 1;
    for (int i = 0; i + 1 < x_ndim; ++i) rows *= x_shape[i];
    const int N = w_shape[0];
    const int words = K / 32 * BITS;          // 32-bit words per weight row
    const int groups = K / G;
    const int quads = K / 128;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int f0 = blockIdx.x * (16 * FT);
    SETUP  // this block's layer: its first feature fb, its features NL

    const uint32_t* wp[FTN][2];
    const S* sp[FTN][2];
    const S* bp[FTN][2];
    #pragma unroll
    for (int ft = 0; ft < FTN; ++ft) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int f = min(fb + 16 * (ft % FT) + 8 * h + g, NL - 1);  // past the end: read, never write
            wp[ft][h] = PART_W(ft / FT) + (size_t)f * words;
            sp[ft][h] = PART_S(ft / FT) + (size_t)f * groups;
            bp[ft][h] = PART_B(ft / FT) + (size_t)f * groups;
        }
    }
    float acc[FTN][RT][4];
    #pragma unroll
    for (int ft = 0; ft < FTN; ++ft) {
        #pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[ft][rt][e] = 0.0f;
        }
    }

    for (int q0 = warp * U; q0 < quads; q0 += WARPS * U) {
        // every load of U quads (this lane's chunk of each: codes, scale, bias) first
        uint32_t wd[U][FTN][2][BITS];
        float sraw[U][FTN][2], braw[U][FTN][2];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = 4 * min(q0 + u, quads - 1) + t;  // past the end: loaded, never used
            const int grp = c * 32 / G;
            #pragma unroll
            for (int ft = 0; ft < FTN; ++ft) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t* p = wp[ft][h] + c * BITS;
                    if (BITS == 6) {
                        #pragma unroll
                        for (int i = 0; i < 3; ++i) {
                            const uint2 v = reinterpret_cast<const uint2*>(p)[i];
                            wd[u][ft][h][2 * i] = v.x;
                            wd[u][ft][h][2 * i + 1] = v.y;
                        }
                    } else {
                        #pragma unroll
                        for (int i = 0; i < BITS / 4; ++i) {
                            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
                            wd[u][ft][h][4 * i] = v.x;
                            wd[u][ft][h][4 * i + 1] = v.y;
                            wd[u][ft][h][4 * i + 2] = v.z;
                            wd[u][ft][h][4 * i + 3] = v.w;
                        }
                    }
                    sraw[u][ft][h] = static_cast<float>(sp[ft][h][grp]);
                    braw[u][ft][h] = static_cast<float>(bp[ft][h][grp]);
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (q0 + u >= quads) break;
            const int c = 4 * (q0 + u) + t;
            uint32_t s2[FTN][2], b2[FTN][2];
            #pragma unroll
            for (int ft = 0; ft < FTN; ++ft) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    PACK2(s2[ft][h], sraw[u][ft][h], sraw[u][ft][h]);
                    PACK2(b2[ft][h], braw[u][ft][h], braw[u][ft][h]);
                }
            }
            #pragma unroll
            for (int m = 0; m < 4; ++m) {  // the chunk's groups of 8 codes
                // A registers: the dequantized weights of this lane's two features of each
                // tile (g and g + 8), codes j and j + 4 of the group paired
                uint32_t a[FTN][2][4];
                #pragma unroll
                for (int ft = 0; ft < FTN; ++ft) {
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int bit = 8 * m * BITS;
                        unsigned long long v = wd[u][ft][h][bit / 32];
                        if (bit / 32 + 1 < BITS) v |= (unsigned long long)wd[u][ft][h][bit / 32 + 1] << 32;
                        v >>= bit % 32;
                        uint32_t pair[4];
                        #pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const unsigned lo = (unsigned)(v >> (BITS * j)) & MASK;
                            const unsigned hi = (unsigned)(v >> (BITS * (j + 4))) & MASK;
                            if (PAIRED) {
                                uint32_t q;
                                FMA2(q, MAGIC | lo | (hi << 16), ONE2, MINUS_OFF2);
                                FMA2(pair[j], q, s2[ft][h], b2[ft][h]);
                            } else {
                                const float flo = __uint_as_float(0x4B000000u | lo) - 8388608.0f;
                                const float fhi = __uint_as_float(0x4B000000u | hi) - 8388608.0f;
                                PACK2(pair[j], fmaf(fhi, sraw[u][ft][h], braw[u][ft][h]),
                                      fmaf(flo, sraw[u][ft][h], braw[u][ft][h]));
                            }
                        }
                        a[ft][0][h] = pair[0];
                        a[ft][0][2 + h] = pair[1];
                        a[ft][1][h] = pair[2];
                        a[ft][1][2 + h] = pair[3];
                    }
                }
                #pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    const int r = 8 * rt + g;
                    const uint4 xv = r < rows ? *reinterpret_cast<const uint4*>(x + (size_t)r * K + c * 32 + 8 * m)
                                              : make_uint4(0u, 0u, 0u, 0u);
                    const uint32_t b0 = __byte_perm(xv.x, xv.z, 0x5410);
                    const uint32_t b1 = __byte_perm(xv.x, xv.z, 0x7632);
                    const uint32_t b2r = __byte_perm(xv.y, xv.w, 0x5410);
                    const uint32_t b3 = __byte_perm(xv.y, xv.w, 0x7632);
                    #pragma unroll
                    for (int ft = 0; ft < FTN; ++ft) {
                        MMA(acc[ft][rt], a[ft][0], b0, b1);
                        MMA(acc[ft][rt], a[ft][1], b2r, b3);
                    }
                }
            }
        }
    }

    if (WARPS > 1) {
        __shared__ float partial[(WARPS > 1 ? WARPS - 1 : 1) * FTN * RT * 4 * 32];
        if (warp > 0) {
            #pragma unroll
            for (int ft = 0; ft < FTN; ++ft) {
                #pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        partial[((((warp - 1) * FTN + ft) * RT + rt) * 4 + e) * 32 + lane] = acc[ft][rt][e];
                }
            }
        }
        __syncthreads();
        if (warp > 0) return;
        for (int k = 0; k < WARPS - 1; ++k) {
            #pragma unroll
            for (int ft = 0; ft < FTN; ++ft) {
                #pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[ft][rt][e] += partial[(((k * FTN + ft) * RT + rt) * 4 + e) * 32 + lane];
                }
            }
        }
    }
    #pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
        #pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int f = fb + 16 * ft + g + 8 * (e >> 1);
                const int r = 8 * rt + 2 * t + (e & 1);
                if (f < NL && r < rows) STORE(r, f, OUTPUT(acc[ft][rt][e], acc[(ft + FT) % FTN][rt][e]));
            }
        }
    }
"""

# Two half floats' instructions, bf16 or fp16 by ``BF`` (both spelled out: NVRTC compiles
# the branch not taken, and each is valid PTX on sm_80), and the tensor-core call
# accumulating into a float4 of ``acc``.
MACROS = r"""
#define FMA2(d, a, b, c) do { if (BF) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); \
    else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); } while (0)
#define PACK2(d, hi, lo) do { if (BF) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); \
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); } while (0)
#define MMA(c, a, b0, b1) do { if (BF) asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " \
    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)); \
    else asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " \
    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)); } while (0)
"""

BODY = MACROS.strip() + "\n" + compact(_SOURCE)

# A plain product reads one layer; a gated one (an MLP's ``silu(x @ gate.T) * (x @ up.T)``,
# :mod:`glu_cuda`) reads the same features of two (``w2``... the up projection's), each
# block ``FT`` tiles of each, and writes the swiglu of each pair, rounded as MLX's products
# and mlx-lm's swiglu round it (each product to T, then the sigmoid, its product with the
# gate and that with up, each to T).
PLAIN = """constexpr int FTN = FT;
#define SETUP const int fb = f0; const int NL = N;
#define PART_W(p) w
#define PART_S(p) scales
#define PART_B(p) biases
#define OUTPUT(v, u) static_cast<T>(v)
#define STORE(r, f, v) out[(size_t)(r) * N + (f)] = (v)
"""
GATED = """constexpr int FTN = 2 * FT;
#define SETUP const int fb = f0; const int NL = N;
#define STORE(r, f, v) out[(size_t)(r) * N + (f)] = (v)
#define PART_W(p) ((p) ? w2 : w)
#define PART_S(p) ((p) ? scales2 : scales)
#define PART_B(p) ((p) ? biases2 : biases)
""" + SWIGLU + """#define OUTPUT(g, u) gmlx_swiglu(g, u)
"""


def parts_head(sizes: tuple[int, ...]) -> str:
    """Products of two or three layers of one layout and input (an attention's queries,
    keys and values) in one launch: the blocks cover their features one layer after the
    other (each layer's a whole number of blocks), and each layer's are written to its
    own output: ``w, scales, biases`` then ``w2...`` and ``w3...``; ``out``, ``out2``,
    ``out3``."""
    suffix = ["", "2", "3"][:len(sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def pick(values: list[str]) -> str:  # the block's layer's value
        expr = values[-1]
        for i in range(len(sizes) - 2, -1, -1):
            expr = f"(part == {i} ? {values[i]} : {expr})"
        return expr

    part = " : ".join(f"f0 < {starts[i + 1]} ? {i}" for i in range(len(sizes) - 1)) + f" : {len(sizes) - 1}"
    store = " else ".join(f"if (part == {i}) out{x}[(size_t)(r) * {n} + (f)] = (v);"
                          for i, (x, n) in enumerate(zip(suffix, sizes, strict=True)))
    return ("constexpr int FTN = FT;\n"
            f"#define SETUP const int part = {part}; const int fb = f0 - {pick([str(v) for v in starts])}; "
            f"const int NL = {pick([str(n) for n in sizes])}; "
            f"const uint32_t* wl = {pick([f'w{x}' for x in suffix])}; const S* sl = {pick([f'scales{x}' for x in suffix])}; "
            f"const S* bl = {pick([f'biases{x}' for x in suffix])};\n"
            "#define PART_W(p) wl\n#define PART_S(p) sl\n#define PART_B(p) bl\n"
            "#define OUTPUT(v, u) static_cast<T>(v)\n"
            f"#define STORE(r, f, v) {{ {store} }}\n")
