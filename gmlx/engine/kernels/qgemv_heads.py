"""The one-to-eight-row products' heads (:mod:`qgemv_source`'s bodies follow one): what a
product's rows are and where each is written, a plain product, one with a residual, a
gated one or two or three layers read as one."""

from __future__ import annotations

from gmlx.engine.kernels.cuda_source import SWIGLU

# What a product's rows are and what it writes: a plain product's warp takes RPW weight
# rows and writes each; a gated one's (``glu``) takes RPW / 2 rows of the gate's weights
# and the same rows of the up projection's (``w2``...), and writes silu(gate) * up for
# each, rounded as MLX's products and its swiglu round them (each product to T, then
# sigmoid, the product with it and the one with up, each to T).
PLAIN = """constexpr int OUTS = RPW;
#define ROWS_TOTAL w_shape[0]
#define ROW_W(r, n) (w + (size_t)(n) * words)
#define ROW_S(r, n) (scales + (size_t)(n) * groups)
#define ROW_B(r, n) (biases + (size_t)(n) * groups)
#define OUTPUT(v, u) static_cast<T>(v)
#define STORE(m, n, v) out[(size_t)(m) * N + (n)] = (v)
"""
# A plain product with a residual added as it is written (``res``, the output's shape): the
# product rounded to T as MLX's product rounds it, then the sum rounded to T as MLX's add
# of two T rounds it (a float sum of two half floats rounded once: the same bits), so
# ``x + layer(y)`` is one launch with the same bits as the two operations.
RESIDUAL = PLAIN.replace("#define STORE(m, n, v) out[(size_t)(m) * N + (n)] = (v)",
                         "#define STORE(m, n, v) out[(size_t)(m) * N + (n)] = static_cast<T>("
                         "static_cast<float>(v) + static_cast<float>(res[(size_t)(m) * N + (n)]))")
GATED = """constexpr int OUTS = RPW / 2;
#define ROWS_TOTAL w_shape[0]
#define ROW_W(r, n) (((r) < OUTS ? w : w2) + (size_t)(n) * words)
#define ROW_S(r, n) (((r) < OUTS ? scales : scales2) + (size_t)(n) * groups)
#define ROW_B(r, n) (((r) < OUTS ? biases : biases2) + (size_t)(n) * groups)
""" + SWIGLU + """#define OUTPUT(g, u) gmlx_swiglu(g, u)
#define STORE(m, n, v) out[(size_t)(m) * N + (n)] = (v)
"""
# The gated product of one stacked layer (:mod:`stacked`): the gate's N rows, then the up
# projection's N, in one array each of weights, scales and biases.
GATED_STACKED = (GATED.replace("#define ROWS_TOTAL w_shape[0]", "#define ROWS_TOTAL (w_shape[0] / 2)")
                 .replace("#define ROW_W(r, n) (((r) < OUTS ? w : w2) + (size_t)(n) * words)",
                          "#define ROW_W(r, n) (w + ((size_t)((r) < OUTS ? 0 : N) + (n)) * words)")
                 .replace("#define ROW_S(r, n) (((r) < OUTS ? scales : scales2) + (size_t)(n) * groups)",
                          "#define ROW_S(r, n) (scales + ((size_t)((r) < OUTS ? 0 : N) + (n)) * groups)")
                 .replace("#define ROW_B(r, n) (((r) < OUTS ? biases : biases2) + (size_t)(n) * groups)",
                          "#define ROW_B(r, n) (biases + ((size_t)((r) < OUTS ? 0 : N) + (n)) * groups)"))


def parts_head(sizes: tuple[int, ...], stacked: bool = False) -> str:
    """A product over two or three layers of one layout and input (an attention's
    queries, keys and values), their weight rows one after another (``sizes`` rows each)
    and each written to its own output: ``w, scales, biases`` then ``w2...`` and ``w3...``,
    or with ``stacked`` all their rows in one ``w, scales, biases`` (:mod:`stacked`);
    ``out``, ``out2``, ``out3``."""
    suffix = ["", "2", "3"][:len(sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def pick(prefix: str, per: str) -> str:  # the part row n lies in, and n's row in it
        if stacked:
            return f"({prefix} + (size_t)(n) * {per})"
        expr = f"({prefix}{suffix[-1]} + (size_t)((n) - {starts[-1]}) * {per})"
        for i in range(len(sizes) - 2, -1, -1):
            expr = f"((n) < {starts[i + 1]} ? {prefix}{suffix[i]} + (size_t)((n) - {starts[i]}) * {per} : {expr})"
        return expr

    store = "out" + suffix[-1] + f"[(size_t)(m) * {sizes[-1]} + (n) - {starts[-1]}] = (v);"
    for i in range(len(sizes) - 2, -1, -1):
        store = (f"if ((n) < {starts[i + 1]}) out{suffix[i]}[(size_t)(m) * {sizes[i]} + (n) - {starts[i]}] = (v); "
                 f"else {{ {store} }}")
    return (f"constexpr int OUTS = RPW;\n#define ROWS_TOTAL {sum(sizes)}\n"
            f"#define ROW_W(r, n) {pick('w', 'words')}\n"
            f"#define ROW_S(r, n) {pick('scales', 'groups')}\n"
            f"#define ROW_B(r, n) {pick('biases', 'groups')}\n"
            "#define OUTPUT(v, u) static_cast<T>(v)\n"
            f"#define STORE(m, n, v) {{ {store} }}\n")
