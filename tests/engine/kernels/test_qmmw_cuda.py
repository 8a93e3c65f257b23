"""The wide-load tensor-core kernel's arithmetic, replayed here in numpy lane by lane,
and its own source run on the CPU with its PTX instructions emulated (CUDA cannot run on
this machine; on the GPU machine the load-time tuner checks the kernel itself against
MLX's product at every load, and refuses it where it disagrees).

What is replayed: which chunk of which weight row each lane loads, its 8-code windows and
the code pairs it makes, the half-float bit trick (``MAGIC | lo | hi << 16`` is ``OFF +
q``), the two fused multiply-adds that make a pair into weights (rounded once to the
activations' type), the ``__byte_perm`` pairing of ``x`` and the A/B/C register layouts
of ``mma.sync.m16n8k16`` (PTX ISA). Every A and B register slot of every call must be
filled exactly once, and together they must give ``x @ dequantize(w).T``."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import qmmw_cuda, qmmw_source
from gmlx.engine.kernels.timing import agrees, exact_product
from tests.engine.kernels import byte_perm, emulation


def _to_half(values: np.ndarray | float, bf16: bool) -> np.ndarray:
    """Round to the activations' type (round to nearest even), back as float64."""
    v = np.asarray(values, np.float64)
    if not bf16:
        return v.astype(np.float16).astype(np.float64)
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def _halves(word: int, bf16: bool) -> tuple[float, float]:
    lo, hi = word & 0xFFFF, word >> 16
    if bf16:
        return tuple(float(np.array([v << 16], np.uint32).view(np.float32)[0]) for v in (lo, hi))
    return tuple(float(np.array([v], np.uint16).view(np.float16)[0]) for v in (lo, hi))


def _replay(x: np.ndarray, wq: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int,
            group: int, bf16: bool) -> np.ndarray:
    """The kernel's product, computed the way its lanes and tensor-core calls do."""
    rows, k = x.shape
    n = wq.shape[0]
    mask = (1 << bits) - 1
    paired = not (bf16 and bits == 8)
    magic, off = (0x43004300, 128.0) if bf16 else (0x64006400, 1024.0)
    xbits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint64) if bf16 else \
        x.astype(np.float16).view(np.uint16).astype(np.uint64)
    out = np.zeros((rows, n))
    for f0, r0, quad in itertools.product(range(0, n, 16), range(0, rows, 8), range(k // 128)):
        for m, e in itertools.product(range(4), range(2)):  # one mma.sync call each
            a = np.full((16, 16), np.nan)  # [feature][logical k]
            bmat = np.full((16, 8), np.nan)  # [logical k][row]
            for g, t in itertools.product(range(8), range(4)):
                c = 4 * quad + t  # this lane's chunk
                grp = c * 32 // group
                for h in range(2):
                    f = min(f0 + g + 8 * h, n - 1)
                    chunk = [int(v) for v in wq[f, c * bits:(c + 1) * bits]]  # its wide loads
                    bit = 8 * m * bits
                    v = chunk[bit // 32] | ((chunk[bit // 32 + 1] << 32) if bit // 32 + 1 < bits else 0)
                    v >>= bit % 32
                    sh, bh = _to_half(s[f, grp], bf16), _to_half(b[f, grp], bf16)  # PACK2
                    pairs = []
                    for j in range(4):
                        lo, hi = (v >> (bits * j)) & mask, (v >> (bits * (j + 4))) & mask
                        if paired:
                            codes = np.array(_halves(magic | lo | (hi << 16), bf16)) - off  # exact
                            pairs.append(_to_half(codes * sh + bh, bf16))  # one rounding (fma)
                        else:
                            fl = np.float32(np.float32(lo) * np.float32(s[f, grp]) + np.float32(b[f, grp]))
                            fh = np.float32(np.float32(hi) * np.float32(s[f, grp]) + np.float32(b[f, grp]))
                            pairs.append(_to_half(np.array([fl, fh]), bf16))
                    # a[e][h] = pair 2e (logical k 2t, 2t+1), a[e][2 + h] = pair 2e + 1 (2t+8, 2t+9)
                    for reg, pair in ((h, pairs[2 * e]), (2 + h, pairs[2 * e + 1])):
                        row, col = g + 8 * (reg % 2), 2 * t + 8 * (reg // 2)
                        assert np.isnan(a[row, col:col + 2]).all()
                        a[row, col:col + 2] = pair
                r = r0 + g
                if r < rows:
                    base = c * 32 + 8 * m
                    words = [int(sum(int(xbits[r, base + 2 * i + j]) << (16 * j) for j in range(2)))
                             for i in range(4)]
                else:
                    words = [0, 0, 0, 0]
                regs = [byte_perm(words[0], words[2], 0x5410), byte_perm(words[0], words[2], 0x7632),
                        byte_perm(words[1], words[3], 0x5410), byte_perm(words[1], words[3], 0x7632)]
                for i, reg in enumerate(regs[2 * e:2 * e + 2]):  # b0: logical k 2t, 2t+1; b1: 2t+8, 2t+9
                    kk = 2 * t + 8 * i
                    assert np.isnan(bmat[kk:kk + 2, g]).all()
                    bmat[kk:kk + 2, g] = _halves(reg, bf16)
            assert not np.isnan(a).any() and not np.isnan(bmat).any()
            part = a @ bmat  # what the call adds to its float32 accumulators
            for g, rr in itertools.product(range(16), range(8)):
                if f0 + g < n and r0 + rr < rows:
                    out[r0 + rr, f0 + g] += part[g, rr]
    return out


@pytest.mark.parametrize(("bits", "group", "rows", "dtype"), [
    (4, 32, 1, mx.bfloat16), (4, 64, 3, mx.bfloat16), (6, 32, 9, mx.bfloat16),
    (8, 32, 2, mx.bfloat16), (8, 128, 5, mx.float16), (4, 32, 2, mx.float16), (6, 64, 4, mx.float16),
])
def test_the_lanes_compute_the_product(bits: int, group: int, rows: int, dtype: mx.Dtype) -> None:
    mx.random.seed(bits * group + rows)
    n, k = 24, 256  # a partial feature tile, and two quads of four chunks
    wq, s, b = mx.quantize(mx.random.normal((n, k)), group_size=group, bits=bits)
    s, b = s.astype(dtype), b.astype(dtype)  # a model's scales are in its own type
    x = mx.random.normal((rows, k)).astype(dtype)
    bf16 = dtype == mx.bfloat16
    xf = np.array(x.astype(mx.float32)).astype(np.float64)
    got = _replay(xf, np.array(wq), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)),
                  bits, group, bf16)
    # the weights MLX's dequantize makes, in the activations' type; the kernel rounds each
    # once from the exact s * q + b, MLX from its float32 (a last-place difference at most)
    w = np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group,
                               bits=bits))
    want = xf @ _to_half(w, bf16).T
    scale = np.abs(xf) @ np.abs(_to_half(w, bf16)).T
    ulp = 2.0 ** -8 if bf16 else 2.0 ** -11
    assert np.all(np.abs(got - want) <= ulp * scale + 1e-9)
    # and the product itself, to the rounding of the weights to the activations' type
    exact = xf @ w.T
    assert np.all(np.abs(got - exact) <= 2 * ulp * scale + 1e-9)


def test_which_products_may_take_the_kernel() -> None:
    assert qmmw_cuda.supports(1, 4096, 32, 4) and qmmw_cuda.supports(64, 14336, 32, 6)
    assert qmmw_cuda.supports(8, 4096, 128, 8)
    assert not qmmw_cuda.supports(65, 4096, 32, 4)  # a prefill chunk: not decode-sized
    assert not qmmw_cuda.supports(1, 4096, 32, 5)
    assert not qmmw_cuda.supports(1, 4096 + 32, 32, 4)  # K not a whole number of quads
    assert not qmmw_cuda.supports(1, 4096, 32, 4, mode="mxfp4")


def test_every_launch_shape_fits_shared_memory_at_every_row_count() -> None:
    for rows in (1, 8, 9, 16, 32, 64):
        shapes = qmmw_cuda.configs(rows)
        assert shapes
        for ft, warps, _ in shapes:
            tiles = -(-rows // 8)
            assert (warps - 1) * ft * tiles * 4 * 32 * 4 <= 48 * 1024


def test_the_kernel_source_defines_its_instructions_once_and_has_no_comments() -> None:
    body = qmmw_source.BODY
    assert body.startswith("#define FMA2")
    assert "//" not in body.split("#define MMA")[1].split("\n", 4)[-1]
    assert body.count("fma.rn.bf16x2") == 1 and body.count("fma.rn.f16x2") == 1


# -- the kernel's own source, run on the CPU -----------------------------------------------------

# The three instructions the source writes as PTX, for the host: two half floats' fused
# multiply-add (in float32, then rounded), two floats packed as half floats, and the
# tensor-core product, its fragments exchanged through memory between two barriers of
# the warp (PTX ISA's m16n8k16 layouts: A's element (r, k) in lane (r % 8) * 4 + (k % 8) / 2,
# register (r >= 8) + 2 (k >= 8), half k % 2; B's (k, n) in lane n * 4 + (k % 8) / 2,
# register k >= 8, half k % 2; C's (r, n) in lane (r % 8) * 4 + n / 2, element 2 (r >= 8) + n % 2).
_EMULATED = r"""
inline float emu_half(uint32_t v, bool bf) {
    const uint16_t h = (uint16_t)v;
    if (bf) { const uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f; }
    __half x; std::memcpy(&x, &h, 2); return __half2float(x);
}
inline uint32_t emu_round(float f, bool bf) {
    if (bf) { uint32_t u; std::memcpy(&u, &f, 4); return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }
    const __half x = __float2half_rn(f); uint16_t h; std::memcpy(&h, &x, 2); return h;
}
inline uint32_t emu_fma2(uint32_t a, uint32_t b, uint32_t c, bool bf) {
    const float lo = std::fma(emu_half(a, bf), emu_half(b, bf), emu_half(c, bf));
    const float hi = std::fma(emu_half(a >> 16, bf), emu_half(b >> 16, bf), emu_half(c >> 16, bf));
    return emu_round(lo, bf) | (emu_round(hi, bf) << 16);
}
static uint32_t emu_a[32][32][4], emu_b[32][32][2];
inline void emu_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, bool bf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = 0; i < 4; ++i) emu_a[warp][lane][i] = a[i];
    emu_b[warp][lane][0] = b0; emu_b[warp][lane][1] = b1;
    warp_barrier[warp]->arrive_and_wait();
    auto A = [&](int r, int k) { return emu_half(emu_a[warp][(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)] >> (16 * (k % 2)), bf); };
    auto B = [&](int k, int n) { return emu_half(emu_b[warp][n * 4 + (k % 8) / 2][k >= 8] >> (16 * (k % 2)), bf); };
    for (int e = 0; e < 4; ++e) {
        const int r = lane / 4 + 8 * (e / 2), n = 2 * (lane % 4) + e % 2;
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
        c[e] += sum;
    }
    warp_barrier[warp]->arrive_and_wait();
}
#define FMA2(d, a, b, c) d = emu_fma2((a), (b), (c), BF)
#define PACK2(d, hi, lo) d = emu_round((hi), BF) << 16 | emu_round((lo), BF)
#define MMA(c, a, b0, b1) emu_mma(c, a, b0, b1, BF)
"""


def _made(dtype, bits: int, config: tuple[int, int, int], rows: int, gated: bool = False,
          parts: tuple[int, ...] = ()) -> dict:
    """What ``qmmw_cuda`` hands ``mx.fast.cuda_kernel`` for this layout and launch shape."""
    made: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
        qmmw_cuda._kernel.cache_clear()
        try:
            qmmw_cuda._kernel(dtype, dtype, qmmw_cuda.row_tiles(rows), bits, 32, *config, gated, parts)
        finally:
            qmmw_cuda._kernel.cache_clear()
    return made[0]


def _run(tmp_path, dtype, bits: int, config: tuple[int, int, int], x: mx.array, layers: list, *,
         gated: bool = False, parts: bool = False) -> list[mx.array]:
    """The kernel's own source run on the CPU (``emulation``: each block's threads as host
    threads; the PTX instructions as ``_EMULATED``) on ``x`` and ``layers`` (``(w, scales,
    biases)`` each); its outputs."""
    rows, k = x.shape
    sizes = tuple(w.shape[0] for w, _, _ in layers)
    made = _made(dtype, bits, config, rows, gated, sizes if parts else ())
    name = str(dtype).removeprefix("mlx.core.")
    body = emulation.function(made, [name, *["uint32", name, name] * len(layers)], name)
    body = body.replace(qmmw_source.MACROS.strip(), "")
    suffix = ["", "2", "3"]
    names = {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w_shape": "ws"}
    loads, saves = [], []
    outputs = len(layers) if parts else 1
    for i, (w, _, _) in enumerate(layers):
        loads.append(f'auto w{i} = load<uint32_t>("w{i}.bin", {w.size}); auto s{i} = load<E>("s{i}.bin", {w.shape[0] * k // 32}); '
                     f'auto b{i} = load<E>("b{i}.bin", {w.shape[0] * k // 32});')
        names |= {f"w{suffix[i]}": f"w{i}.data()", f"scales{suffix[i]}": f"s{i}.data()", f"biases{suffix[i]}": f"b{i}.data()"}
    for i in range(outputs):
        loads.append(f"std::vector<E> o{i}((size_t){rows} * {sizes[i]});")
        saves.append(f'save("o{i}.bin", o{i});')
        names[f"out{suffix[i]}"] = f"o{i}.data()"
    head = body[body.index("(") + 1:body.index(")")]
    args = ", ".join(names[p.split()[-1].lstrip("*")] for p in head.split(","))
    features = sum(sizes) if parts else sizes[0]
    blocks = -(-features // (16 * config[0]))
    main = (f"int main() {{\n    auto x = load<E>(\"x.bin\", {x.size});\n    " + "\n    ".join(loads)
            + f"\n    Shape xs{{{rows}, {k}}}, ws{{{sizes[0]}, {layers[0][0].shape[1]}}};\n"
            f"    run_blocks({blocks}, {32 * config[1]}, [&] {{ kernel({args}); }});\n    " + "\n    ".join(saves) + "\n}\n")
    program = emulation.PRELUDE + f"using E = {emulation.HOST_TYPES[name]};\n" + _EMULATED + body + main
    (tmp_path / "x.bin").write_bytes(np.array(x.view(mx.uint16)).tobytes())
    for i, (w, s, b) in enumerate(layers):
        for file, a in ((f"w{i}", w), (f"s{i}", s.view(mx.uint16)), (f"b{i}", b.view(mx.uint16))):
            (tmp_path / f"{file}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [])
    return [mx.array(np.frombuffer((tmp_path / f"o{i}.bin").read_bytes(), dtype=np.uint16).reshape(rows, sizes[i]))
            .view(dtype) for i in range(outputs)]


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "rows", "config", "dtype"), [
    (4, 3, (1, 8, 2), mx.bfloat16), (6, 20, (2, 4, 2), mx.bfloat16), (8, 9, (1, 8, 2), mx.bfloat16),
    (4, 20, (1, 8, 2), mx.float16), (6, 5, (2, 4, 2), mx.float16)])
def test_the_kernel_source_itself_is_mlx_product(tmp_path, bits: int, rows: int, config, dtype) -> None:
    """The source MLX compiles, run on the CPU: 40 features (a block's last tile past the
    end), 384 columns (three quads: a warp's second quad past the end), fewer rows of x
    than its tiles take, against MLX's own product, as closely as MLX's is to float32."""
    mx.random.seed(bits * rows)
    n, k = 40, 384
    w, s, b = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=32, bits=bits)
    x = (mx.random.normal((rows, k)) * 2).astype(dtype)
    (got,) = _run(tmp_path, dtype, bits, config, x, [(w, s, b)])
    want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=bits)
    assert agrees(got, want, exact_product(x, w, s, b, 32, bits))
    assert not mx.array_equal(got, mx.zeros_like(got)).item()


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "rows", "dtype"), [(4, 3, mx.bfloat16), (6, 20, mx.float16)])
def test_the_gated_source_is_mlx_products_and_swiglu(tmp_path, bits: int, rows: int, dtype) -> None:
    """An MLP's gate and up projections and its swiglu in one kernel, run on the CPU as
    above, against MLX's two products and mlx-lm's swiglu."""
    from mlx_lm.models.activations import swiglu

    mx.random.seed(bits * rows + 1)
    n, k = 40, 256
    gate, up = (mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=32, bits=bits) for _ in range(2))
    x = (mx.random.normal((rows, k)) * 0.5).astype(dtype)
    (got,) = _run(tmp_path, dtype, bits, qmmw_cuda.configs(rows, gated=True)[0], x, [gate, up], gated=True)

    def product(layer):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=32, bits=bits)

    g, u = (exact_product(x, *layer, 32, bits) for layer in (gate, up))
    assert agrees(got, swiglu(product(gate), product(up)), g * mx.sigmoid(g) * u)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("sizes", "rows", "config"), [((32, 16, 16), 3, (1, 8, 2)), ((64, 32), 20, (2, 4, 2))])
def test_the_parts_source_is_each_layers_product(tmp_path, sizes: tuple[int, ...], rows: int, config) -> None:
    """Two or three layers read in one launch (an attention's queries, keys and values),
    each written to its own output, against MLX's product of each."""
    dtype, bits, k = mx.bfloat16, 4, 256
    mx.random.seed(rows + len(sizes))
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=32, bits=bits) for n in sizes]
    x = mx.random.normal((rows, k)).astype(dtype)
    for got, layer in zip(_run(tmp_path, dtype, bits, config, x, layers, parts=True), layers, strict=True):
        want = mx.quantized_matmul(x, *layer, transpose=True, group_size=32, bits=bits)
        assert agrees(got, want, exact_product(x, *layer, 32, bits))
