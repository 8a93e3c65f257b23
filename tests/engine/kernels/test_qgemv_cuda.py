"""The one-row kernel's arithmetic (``qgemv_cuda``), replayed in numpy (CUDA cannot run on
this machine; the kernel itself is checked against MLX's CPU product on the GPU machine
by ``benchmarks/gpu/gemv_check.py`` and by the tuner at every load there).

What is replayed: each lane's chunk of a weight row (its words, a code across two words
through the 64-bit funnel), the exact float codes, the per-chunk ``s * sum(x q) + b *
sum(x)`` in float32 and the lanes' butterfly of shuffles. Together they must be MLX's
product, as closely as MLX's own is to a float32 one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import qgemv_cuda, qgemv_prepared, qgemv_q8
from gmlx.engine.kernels.cuda_source import kernel_name
from gmlx.engine.kernels.timing import agrees, exact_product
from tests.engine.kernels import byte_perm, emulation
from tests.engine.kernels.qgemv_replay import replay


def test_a_code_bit_pattern_is_its_exact_float() -> None:
    """8-bit: ``2^23 + q``'s float bits minus ``2^23`` is ``q``; 4- and 6-bit: ``q``
    under 0.5's exponent (``0x3F000000 | q << 16``) is the float ``0.5 + q / 256``
    exactly, and ``256 * (f - 0.5)`` gives ``q`` back."""
    codes = np.arange(256, dtype=np.uint32)
    got = (np.uint32(0x4B000000) | codes).view(np.float32) - np.float32(8388608.0)
    assert (got == codes.astype(np.float32)).all()
    small = np.arange(64, dtype=np.uint32)
    f = (np.uint32(0x3F000000) | (small << np.uint32(16))).view(np.float32)
    assert (f == np.float32(0.5) + small.astype(np.float32) / np.float32(256)).all()
    assert (np.float32(256) * (f - np.float32(0.5)) == small.astype(np.float32)).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_byte_permutes_make_every_code_its_float_bits(bits: int) -> None:
    """The kernel's 4- and 8-bit codes: a word's codes (4-bit: its even and odd codes
    masked into bytes first) each one ``__byte_perm`` into its float's bits (4-bit: ``q``
    under 0.5's exponent; 8-bit: ``2^23 + q``), code ``j`` of a chunk where the bit
    stream has it."""
    rng = np.random.default_rng(bits)
    for words in rng.integers(0, 2**32, size=(50, bits), dtype=np.uint64).tolist():
        stream = sum(w << (32 * i) for i, w in enumerate(words))
        for j in range(32):
            code = (stream >> (bits * j)) & ((1 << bits) - 1)
            if bits == 4:
                word = words[j // 8] >> 4 if j & 1 else words[j // 8]
                got = byte_perm(word & 0x0F0F0F0F, 0x3F000000, 0x7054 | (((j % 8) >> 1) << 8))
                assert got == 0x3F000000 | (code << 16)
            else:
                got = byte_perm(words[j // 4], 0x4B000000, 0x7540 | (j & 3))
                assert got == 0x4B000000 | code


@pytest.mark.parametrize(("bits", "group", "k"), [(4, 32, 256), (4, 64, 1088), (6, 32, 320), (6, 128, 512),
                                                  (8, 32, 256), (8, 64, 192)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_the_kernel_arithmetic_is_mlx_product(bits: int, group: int, k: int, dtype) -> None:
    """More than 32 chunks (k 1088: lanes take a second chunk), a code across two words
    (6-bit), groups wider than a chunk (a group's scale shared by two or four lanes)."""
    mx.random.seed(bits * k + group)
    wq, s, b = mx.quantize(mx.random.normal((12, k)).astype(dtype), group_size=group, bits=bits)
    x = (mx.random.normal((1, k)) * 3).astype(dtype)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
    exact = exact_product(x, wq, s, b, group, bits)
    got = replay(np.array(x.astype(mx.float32)), np.array(wq),
                            np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), group, bits)
    got = mx.array(got)[None].astype(dtype)  # the kernel writes its float32 sums as T
    assert agrees(got, want, exact)
    assert mx.allclose(got.astype(mx.float32), exact, rtol=1e-2, atol=1e-2 * mx.abs(exact).max().item())


def test_which_products_it_takes() -> None:
    assert qgemv_cuda.supports(1, 4096, 32, 4) and qgemv_cuda.supports(1, 14336, 32, 6)
    assert qgemv_cuda.supports(8, 4096, 32, 4)  # the few-rows source, up to eight
    assert not qgemv_cuda.supports(9, 4096, 32, 4)
    assert not qgemv_cuda.supports(1, 4096, 32, 3)  # 3-bit: not a layout it reads
    assert not qgemv_cuda.supports(1, 4096, 32, 4, mode="mxfp4")
    assert not qgemv_cuda.supports(1, 4100, 32, 4)  # not whole chunks
    assert all(rows <= 32 for _, rows, *_ in qgemv_cuda.configs())  # lane r writes row r
    assert all(c[2] == 4 for c in qgemv_cuda.configs(4))  # a bucket's kernels take its rows


def test_split_shapes_only_where_asked_and_where_each_warp_has_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split shapes are timed unless ``GMLX_SPLIT_K=0`` (by default since 12-07), for
    a row wide enough that each warp of a group gets a chunk a lane, by every one-row
    tuner; they launch as many groups of warps a block as their warps over the split, at
    one unstaged row only."""
    monkeypatch.setenv(qgemv_cuda.SPLIT_ENV, "0")
    assert qgemv_cuda.splits(14336) == []
    monkeypatch.delenv(qgemv_cuda.SPLIT_ENV)  # the default
    assert qgemv_cuda.splits(14336) == qgemv_cuda.SPLIT
    monkeypatch.setenv(qgemv_cuda.SPLIT_ENV, "1")
    assert qgemv_cuda.splits(14336) == qgemv_cuda.SPLIT
    assert qgemv_cuda.splits(4096) == [(4, 4, 1, 1, 0, 4), (8, 2, 1, 1, 0, 4), (8, 4, 1, 1, 0, 2),
                                      (16, 4, 1, 1, 0, 4)]  # 128 chunks: not eight ways
    assert qgemv_cuda.splits(1024) == []
    assert qgemv_cuda.launch_shape((8, 2, 1, 1, 0, 4)) == (8, 2, 1, 1, 0, 4, 1)
    assert qgemv_cuda.launch_shape((4, 2)) == (4, 2, 1, 1, 0, 1, 1)
    grids: list[tuple] = []
    monkeypatch.setattr(qgemv_cuda, "kernel_of", lambda *a, **kw: lambda **call: grids.append(call["grid"]) or [None])
    w = mx.zeros((4096, 14336 // 8), mx.uint32)
    s = mx.zeros((4096, 14336 // 32), mx.float16)
    for config in ((8, 2, 1, 1, 0, 4), (4, 4)):
        qgemv_cuda.bound(w, s, s, 32, 4, config)(mx.zeros((1, 14336), mx.float16))
    assert grids == [(4096 // 4 * 256, 1, 1), (4096 // 16 * 128, 1, 1)]  # blocks of 2 x 2 rows; of 4 x 4
    for kind in ({"max_rows": 4}, {"tiles": 1, "k": 4096}):  # one unstaged row only
        with pytest.raises(ValueError, match="split"):
            qgemv_cuda._kernel(mx.float16, 4, 32, 8, 2, split=4, **kind)
    with pytest.raises(ValueError, match="split"):
        qgemv_cuda._kernel(mx.float16, 4, 32, 6, 2, split=4)  # warps not a whole number of groups
    assert (4, 4, 1, 1, 0, 4) in qgemv_cuda.gated_configs(1, 4096)  # the step kernels' tuners time them too
    assert (8, 2, 1, 1, 0, 4) in qgemv_cuda.configs(1, 4096) and qgemv_cuda.configs(1, 1024)[-1][4:] == ()


def test_each_layout_is_a_kernel_of_its_own_with_its_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX rebuilds a custom kernel's source at every call: the constants go into the
    source once per layout (no template arguments to hash per call), comments out.
    (``cuda_kernel`` stands in here: MLX has no CUDA backend on this machine.)"""
    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    qgemv_cuda._kernel.cache_clear()
    try:
        first = qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2)
        assert qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2) is first  # built once
        qgemv_cuda._kernel(mx.bfloat16, 6, 64, 8, 1)
    finally:
        qgemv_cuda._kernel.cache_clear()
    assert [k["name"].rsplit("_", 1)[0] for k in made] == ["gmlx_qgemv_half_4_32_4_2_1",
                                                          "gmlx_qgemv_nv_bfloat16_6_64_8_1_1"]
    assert all(k["name"] == kernel_name(k["name"].rsplit("_", 1)[0], k["source"]) for k in made)
    source = made[1]["source"]
    assert source.startswith("using T = __nv_bfloat16; constexpr int BITS = 6; constexpr int G = 64; "
                             "constexpr int WARPS = 8; constexpr int RPW = 1;")
    assert "//" not in source and "x_shape" not in source  # x may have any leading shape


def test_a_kernel_is_named_for_its_whole_source() -> None:
    """MLX keeps compiled kernels on disk under their names alone: a changed source (or
    constant) must get a new name, or a later gmlx would run the code it replaced."""
    head = "using T = __half; constexpr int BITS = 4;\n"
    name = kernel_name("gmlx_qgemv_half_4", head + "body();")
    assert name == kernel_name("gmlx_qgemv_half_4", head + "body();")  # stable across processes
    assert name.startswith("gmlx_qgemv_half_4_")
    assert name != kernel_name("gmlx_qgemv_half_4", head + "body2();")
    assert name != kernel_name("gmlx_qgemv_half_4", head.replace("4;", "8;") + "body();")


# -- the kernels' own source, run on the CPU ---------------------------------------------------

_MAIN = r"""
int main(int argc, char** argv) {
    const int rows = std::atoi(argv[1]), K = std::atoi(argv[2]), N = std::atoi(argv[3]), G_ = std::atoi(argv[4]);
    const int BITS_ = std::atoi(argv[5]), warps = std::atoi(argv[6]), rpw = std::atoi(argv[7]);
    const int tiles = std::max(1, std::atoi(argv[8]));
    const int split = argc > 9 ? std::atoi(argv[9]) : 1;  // warps a row's K is split between
    auto x = load<E>("x.bin", (size_t)rows * K);
    auto w = load<uint32_t>("w.bin", (size_t)N * K / 32 * BITS_);
    auto s = load<E>("s.bin", (size_t)N * K / G_);
    auto b = load<E>("b.bin", (size_t)N * K / G_);
    std::vector<E> out((size_t)rows * N);
    Shape xs{rows, K}, ws{N, K / 32 * BITS_};
    const int per = warps * rpw * tiles / split;  // weight rows a block
    const int blocks = (N + per - 1) / per;
    run_blocks(blocks, 32 * warps, [&] { kernel(ARGS); });
    save("out.bin", out);
}
"""

# the gated kernel's main: the up projection's weights too, half a warp's rows written
_GATED_MAIN = _MAIN.replace("    std::vector<E> out(", """    auto w2 = load<uint32_t>("w2.bin", (size_t)N * K / 32 * BITS_);
    auto s2 = load<E>("s2.bin", (size_t)N * K / G_);
    auto b2 = load<E>("b2.bin", (size_t)N * K / G_);
    std::vector<E> out(""").replace("warps * rpw", "warps * (rpw / 2)")
# the stacked gated kernel's (stacked.py): the gate's rows then the up projection's, in one array each
_STACKED_GATED_MAIN = (_MAIN.replace("(size_t)N * K / 32 * BITS_", "(size_t)2 * N * K / 32 * BITS_")
                       .replace("(size_t)N * K / G_", "(size_t)2 * N * K / G_").replace("ws{N,", "ws{2 * N,")
                       .replace("warps * rpw", "warps * (rpw / 2)"))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "group", "rows", "config"), [
    (4, 32, 1, (4, 2)), (6, 64, 1, (8, 1)), (8, 32, 1, (4, 4)),
    (4, 32, 1, (4, 2, 1, 2)), (6, 64, 1, (8, 1, 1, 3)), (8, 32, 1, (4, 4, 1, 2)),
    (4, 32, 3, (4, 1, 4)), (6, 32, 8, (4, 2, 8)), (8, 64, 2, (8, 1, 2)), (4, 128, 5, (4, 2, 8)),
    (4, 32, 1, (2, 2, 1, 1, 2)), (6, 64, 1, (2, 1, 1, 2, 3)), (8, 32, 1, (4, 2, 1, 2, 1)), (4, 128, 1, (2, 4, 1, 1, 1)),
    (4, 32, 1, (4, 2, 1, 1, 0, 4)), (6, 32, 1, (8, 2, 1, 2, 0, 2)), (8, 64, 1, (4, 4, 1, 1, 0, 2)),
    (4, 128, 1, (8, 1, 1, 1, 0, 8)),
    (4, 32, 1, (4, 2, 1, 1, 0, 1, 4)), (6, 64, 1, (4, 4, 1, 1, 0, 1, 2)), (8, 32, 1, (8, 2, 1, 1, 0, 1, 2)),
    (4, 128, 1, (2, 4, 1, 1, 0, 1, 4))])
def test_the_kernel_source_itself_is_mlx_product(tmp_path, bits: int, group: int, rows: int, config) -> None:
    """The one-row, the few-rows, the staged and the split sources, each warp run as 32
    host threads with CUDA's shuffles and bit instructions emulated: 1,088 columns (lanes
    take a second chunk; at depths 2 and 3 in the same round of loads, some lanes one
    chunk, none a third; K split four or eight ways, some warps no chunk at all), 12
    weight rows (a block's last warp past the end; staged, a block's last tile or warp of
    a tile; split, a block's last group of warps past the end, reading and never
    writing), fewer rows of x than the kernel takes (5 of 8), against MLX's own product
    on the CPU, as closely as MLX's is to float32."""
    dtype = mx.bfloat16
    k, n = _width(config, group, 1088 if group != 128 else 1152), 12
    mx.random.seed(bits * rows + group)
    wq, s, b = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits)
    x = (mx.random.normal((rows, k)) * 3).astype(dtype)
    body = emulation.function(_made(dtype, bits, group, config, k=k), ["bfloat16", "uint32", "bfloat16", "bfloat16"],
                              "bfloat16")
    args = ", ".join({"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w": "w.data()", "w_shape": "ws",
                      "scales": "s.data()", "biases": "b.data()", "out": "out.data()"}[name]
                     for name in emulation.parameters(body))
    program = emulation.PRELUDE + "using E = __nv_bfloat16;\n" + body + _MAIN.replace("ARGS", args)
    for name, a in (("x", x.view(mx.uint16)), ("w", wq), ("s", s.view(mx.uint16)), ("b", b.view(mx.uint16))):
        (tmp_path / f"{name}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [rows, k, n, group, bits, config[0], config[1], _tiles(config),
                                                  _split(config)])
    got = mx.array(np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16).reshape(rows, n)).view(dtype)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
    assert agrees(got, want, exact_product(x, wq, s, b, group, bits))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "rows", "config", "dtype"), [(4, 1, (4, 2, 1, 2), mx.bfloat16),
                                                               (6, 1, (4, 4), mx.float16),
                                                               (4, 3, (4, 1, 4), mx.bfloat16),
                                                               (6, 1, (4, 2, 1, 1, 0, 4), mx.float16),
                                                               (4, 1, (4, 2, 1, 1, 0, 1, 3), mx.float16)])
def test_the_residual_is_added_as_mlx_adds_it(tmp_path, bits: int, rows: int, config, dtype) -> None:
    """A plain product with a residual added as it is written (``bound(...,
    residual=True)``: the attention's output projection and the MLP's down projection
    adding the block's input): bit for bit the kernel's own product (the same source
    without it) plus the residual as MLX adds two arrays of the float type, and close to
    MLX's product plus that residual."""
    k, n, group = _width(config, 32), 12, 32
    mx.random.seed(bits + rows)
    wq, s, b = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits)
    x = (mx.random.normal((rows, k)) * 3).astype(dtype)
    r = (mx.random.normal((rows, n)) * 40).astype(dtype)  # large beside the product: the sum's rounding shows
    name = str(dtype).removeprefix("mlx.core.")
    outs = []
    for residual in (False, True):
        made = _made(dtype, bits, group, config, residual=residual)
        assert ("res" in made["input_names"]) == residual
        body = emulation.function(made, [name, "uint32", name, name, *([name] if residual else [])], name)
        args = ", ".join({"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w": "w.data()", "w_shape": "ws",
                          "scales": "s.data()", "biases": "b.data()", "res": "res.data()", "out": "out.data()"}[p]
                         for p in emulation.parameters(body))
        main = _MAIN.replace("ARGS", args).replace("    std::vector<E> out(",
                                                   '    auto res = load<E>("r.bin", (size_t)rows * N);\n'
                                                   "    std::vector<E> out(")
        program = emulation.PRELUDE + f"using E = {emulation.HOST_TYPES[name]};\n" + body + main
        for file, a in (("x", x.view(mx.uint16)), ("w", wq), ("s", s.view(mx.uint16)), ("b", b.view(mx.uint16)),
                        ("r", r.view(mx.uint16))):
            (tmp_path / f"{file}.bin").write_bytes(np.array(a).tobytes())
        emulation.compile_and_run(tmp_path, program, [rows, k, n, group, bits, config[0], config[1], _tiles(config),
                                                      _split(config)])
        outs.append(mx.array(np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16).reshape(rows, n))
                    .view(dtype))
    product, summed = outs
    assert mx.array_equal(summed, product + r).item()  # MLX's add of the kernel's own product: the same bits
    assert not mx.array_equal(summed, product).item()
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
    assert agrees(product, want, exact_product(x, wq, s, b, group, bits))


def _tiles(config: tuple[int, ...]) -> int:
    return qgemv_cuda.launch_shape(config)[4]


def _split(config: tuple[int, ...]) -> int:
    return qgemv_cuda.launch_shape(config)[5]


def _width(config: tuple[int, ...], group: int, plain: int = 1088) -> int:
    """The row width a source is run at: ``plain`` (1,088: lanes with one chunk and with
    two); K split, 2,176 (68 chunks: two or three warps of a group with chunks to sum, the
    rest none); streamed, a second round part full where the groups allow it (1,280: 40
    chunks; groups of 64, 1,536; of 128, two whole rounds), each row's scales on 16 bytes."""
    if qgemv_cuda.launch_shape(config)[6] > 1:
        return {32: 1280, 64: 1536}.get(group, 2048)
    return 2176 if _split(config) > 1 else plain


def _made(dtype, bits: int, group: int, config: tuple[int, ...], gated: bool = False,
          parts: tuple[int, ...] = (), k: int = 0, residual: bool = False, eps: float | None = None,
          stacked: bool = False) -> dict:
    """What ``qgemv_cuda`` hands ``mx.fast.cuda_kernel`` for this layout and launch shape
    (``k``: the row width the staged shapes are built for)."""
    made: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
        qgemv_cuda._kernel.cache_clear()
        try:
            qgemv_cuda.kernel_of(dtype, bits, group, config, gated, parts, k, residual, eps, stacked)
        finally:
            qgemv_cuda._kernel.cache_clear()
    return made[0]


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "group", "rows", "config"), [
    (4, 32, 1, (4, 2)), (4, 64, 1, (4, 4)), (6, 32, 1, (8, 2)), (4, 32, 1, (4, 4, 1, 2)), (4, 32, 3, (4, 2, 4)),
    (6, 64, 8, (4, 4, 8)), (4, 32, 1, (2, 4, 1, 1, 2)), (6, 64, 1, (2, 2, 1, 2, 1)),
    (4, 32, 1, (4, 4, 1, 1, 0, 4)), (6, 64, 1, (8, 2, 1, 1, 0, 2)), (4, 32, 1, (4, 2, 1, 1, 0, 1, 4))])
@pytest.mark.parametrize("stacked", [False, True])
def test_the_gated_source_is_mlx_products_and_swiglu(tmp_path, bits: int, group: int, rows: int, config,
                                                     stacked: bool) -> None:
    """The gated product (an MLP's gate and up projections and its swiglu in one
    kernel), each source run on the CPU as above: 11 output rows (a warp's second row and
    a block's last warp past the end), against MLX's two products and mlx-lm's swiglu,
    as closely as those are to the float32 products through a float32 swiglu; the two
    layers apart, or stacked into one array each (:mod:`stacked`)."""
    from mlx_lm.models.activations import swiglu

    dtype = mx.bfloat16
    k, n = _width(config, group), 11
    mx.random.seed(bits * rows + group + 1)
    gate = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits)
    up = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits)
    x = (mx.random.normal((rows, k)) * 0.5).astype(dtype)
    made = _made(dtype, bits, group, config, gated=True, k=k, stacked=stacked)
    layers = 1 if stacked else 2
    assert made["input_names"] == ["x", "w", "scales", "biases", "w2", "scales2", "biases2"][:1 + 3 * layers]
    body = emulation.function(made, ["bfloat16", *["uint32", "bfloat16", "bfloat16"] * layers], "bfloat16")
    names = {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w": "w.data()", "w_shape": "ws",
             "scales": "s.data()", "biases": "b.data()", "w2": "w2.data()", "scales2": "s2.data()",
             "biases2": "b2.data()", "out": "out.data()"}
    args = ", ".join(names[name] for name in emulation.parameters(body))
    main = _STACKED_GATED_MAIN if stacked else _GATED_MAIN
    program = emulation.PRELUDE + "using E = __nv_bfloat16;\n" + body + main.replace("ARGS", args)
    if stacked:
        files = (("x", x.view(mx.uint16)), ("w", mx.concatenate([gate[0], up[0]])),
                 ("s", mx.concatenate([gate[1], up[1]]).view(mx.uint16)),
                 ("b", mx.concatenate([gate[2], up[2]]).view(mx.uint16)))
    else:
        files = (("x", x.view(mx.uint16)), ("w", gate[0]), ("s", gate[1].view(mx.uint16)),
                 ("b", gate[2].view(mx.uint16)), ("w2", up[0]), ("s2", up[1].view(mx.uint16)),
                 ("b2", up[2].view(mx.uint16)))
    for name, a in files:
        (tmp_path / f"{name}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [rows, k, n, group, bits, config[0], config[1], _tiles(config),
                                                  _split(config)])
    got = mx.array(np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16).reshape(rows, n)).view(dtype)

    def product(layer):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=group, bits=bits)

    want = swiglu(product(gate), product(up))
    g, u = (exact_product(x, *layer, group, bits) for layer in (gate, up))
    exact = g * mx.sigmoid(g) * u
    assert agrees(got, want, exact)
    assert not mx.array_equal(got, mx.zeros_like(got)).item()


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "sizes", "rows", "config"), [
    (4, (10, 3, 3), 1, (4, 2)), (4, (12, 4), 1, (4, 4)), (6, (10, 3, 3), 1, (8, 1)),
    (4, (10, 3, 3), 3, (4, 2, 4)), (6, (12, 4), 8, (4, 1, 8)), (4, (10, 3, 3), 1, (2, 2, 1, 1, 2)),
    (4, (10, 3, 3), 1, (8, 2, 1, 1, 0, 4)), (4, (10, 3, 3), 1, (4, 2, 1, 1, 0, 1, 2))])
@pytest.mark.parametrize("stacked", [False, True])
def test_the_parts_source_is_each_layers_product(tmp_path, bits: int, sizes: tuple[int, ...], rows: int,
                                                 config, stacked: bool) -> None:
    """Two or three layers of one layout read as one product (an attention's queries, keys
    and values), each written to its own output: a warp's rows across a layer's end (10
    then 3 rows), a block's last warp past the end, one row and a few, against MLX's own
    product of each layer; the layers apart, or stacked into one array each
    (:mod:`stacked`)."""
    dtype, k, group = mx.bfloat16, _width(config, 32), 32
    mx.random.seed(bits * rows + len(sizes))
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits) for n in sizes]
    x = (mx.random.normal((rows, k)) * 2).astype(dtype)
    made = _made(dtype, bits, group, config, parts=sizes, k=k, stacked=stacked)
    suffix = ["", "2", "3"][:len(sizes)]
    assert made["output_names"] == [f"out{i}" for i in suffix]
    arrays = 1 if stacked else len(sizes)
    assert len(made["input_names"]) == 1 + 3 * arrays
    body = emulation.function(made, ["bfloat16", *["uint32", "bfloat16", "bfloat16"] * arrays], "bfloat16")
    total = sum(sizes)
    loads, saves, names = [], [], {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w_shape": "ws"}
    files = [mx.concatenate([layer[j] for layer in layers]) for j in range(3)] if stacked else None
    for i, (sfx, n) in enumerate(zip(suffix, sizes, strict=True)):
        if i < arrays:
            rows_in = total if stacked else n
            loads.append(f'auto w{i} = load<uint32_t>("w{i}.bin", (size_t){rows_in} * K / 32 * BITS_); '
                         f'auto s{i} = load<E>("s{i}.bin", (size_t){rows_in} * K / G_); '
                         f'auto b{i} = load<E>("b{i}.bin", (size_t){rows_in} * K / G_); ')
            names |= {f"w{sfx}": f"w{i}.data()", f"scales{sfx}": f"s{i}.data()", f"biases{sfx}": f"b{i}.data()"}
        loads.append(f'std::vector<E> o{i}((size_t)rows * {n});')
        saves.append(f'save("o{i}.bin", o{i});')
        names |= {f"out{sfx}": f"o{i}.data()"}
    args = ", ".join(names[name] for name in emulation.parameters(body))
    main = (r"""
int main(int argc, char** argv) {
    const int rows = std::atoi(argv[1]), K = std::atoi(argv[2]), G_ = std::atoi(argv[4]);
    const int BITS_ = std::atoi(argv[5]), warps = std::atoi(argv[6]), rpw = std::atoi(argv[7]);
    auto x = load<E>("x.bin", (size_t)rows * K);
    LOADS
    Shape xs{rows, K}, ws{SIZE0, K / 32 * BITS_};
    const int N = std::atoi(argv[3]), tiles = std::max(1, std::atoi(argv[8]));
    const int split = argc > 9 ? std::atoi(argv[9]) : 1;
    const int per = warps * rpw * tiles / split;  // weight rows a block
    const int blocks = (N + per - 1) / per;
    run_blocks(blocks, 32 * warps, [&] { kernel(ARGS); });
    SAVES
}
""".replace("LOADS", "\n    ".join(loads)).replace("SAVES", "\n    ".join(saves))
            .replace("SIZE0", str(total if stacked else sizes[0])).replace("ARGS", args))
    program = emulation.PRELUDE + "using E = __nv_bfloat16;\n" + body + main
    (tmp_path / "x.bin").write_bytes(np.array(x.view(mx.uint16)).tobytes())
    for i, (wq, sc, bi) in enumerate([files] if stacked else layers):
        for name, a in ((f"w{i}", wq), (f"s{i}", sc.view(mx.uint16)), (f"b{i}", bi.view(mx.uint16))):
            (tmp_path / f"{name}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [rows, k, total, group, bits, config[0], config[1], _tiles(config),
                                                  _split(config)])
    for i, (n, (wq, sc, bi)) in enumerate(zip(sizes, layers, strict=True)):
        got = mx.array(np.frombuffer((tmp_path / f"o{i}.bin").read_bytes(), dtype=np.uint16).reshape(rows, n))
        got = got.view(dtype)
        want = mx.quantized_matmul(x, wq, sc, bi, transpose=True, group_size=group, bits=bits)
        assert agrees(got, want, exact_product(x, wq, sc, bi, group, bits)), i


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "group", "config", "gated", "dtype", "prepared"), [
    (4, 32, (4, 2), False, mx.bfloat16, False), (6, 64, (8, 1, 1, 2), False, mx.float16, False),
    (4, 32, (4, 4, 1), True, mx.float16, False), (4, 64, (4, 4, 1, 2), True, mx.bfloat16, False),
    (6, 32, (4, 2, 1), True, mx.float16, False),
    (4, 32, (4, 2, 1, 1, 0, 4), False, mx.bfloat16, False), (4, 64, (8, 4, 1, 1, 0, 2), True, mx.float16, False),
    (4, 32, (4, 4, 1, 1, 0, 1, 2), True, mx.float16, False), (6, 64, (4, 2, 1, 1, 0, 1, 4), False, mx.bfloat16, False),
    (4, 32, (4, 2), False, mx.bfloat16, True), (4, 32, (4, 4, 1), True, mx.float16, True),
    (6, 64, (8, 2, 1), True, mx.bfloat16, True), (8, 64, (4, 1), False, mx.float16, True)])
def test_the_norm_folded_into_the_one_row_source_is_mlx_norm_then_product(
        tmp_path, monkeypatch: pytest.MonkeyPatch, bits: int, group: int, config, gated: bool, dtype,
        prepared: bool) -> None:
    """The one-row source with an RMSNorm folded in (``bound(..., norm=(weight, eps))``:
    the MLP's gate-up-swiglu reading the block's hidden state, not its norm's output),
    run on the CPU as above over 1,088 values (lanes with one chunk and with two, at depth
    1 and 2), and with x prepared once a block (``GMLX_PREPARED=1``): as close to a
    float32 norm and product (and float32 swiglu) as MLX's norm then MLX's product (and
    mlx-lm's swiglu) are, and not the plain product of the un-normed row."""
    from mlx_lm.models.activations import swiglu

    k, n, eps = _width(config, group), 11, 1e-5
    name = str(dtype).removeprefix("mlx.core.")
    mx.random.seed(bits + group + gated)
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits)
              for _ in range(2 if gated else 1)]
    h = (mx.random.normal((1, k)) * 7 + 2).astype(dtype)  # far from unit RMS: the scale shows
    nw = (mx.random.uniform(shape=(k,)) + 0.5).astype(dtype)
    monkeypatch.setenv(qgemv_prepared.ENV, "all" if prepared else "0")  # (1: the gated products alone)
    made = _made(dtype, bits, group, config, gated=gated, k=k, eps=eps)
    assert made["input_names"][-1] == "nw" and f"EPS = {eps!r}f" in str(made)
    assert ("_p_" in made["name"]) == prepared
    types = [name, *(["uint32", name, name] * len(layers)), name]
    body = emulation.function(made, types, name)
    names = {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w": "w.data()", "w_shape": "ws", "scales": "s.data()",
             "biases": "b.data()", "w2": "w2.data()", "scales2": "s2.data()", "biases2": "b2.data()",
             "nw": "nw.data()", "out": "out.data()"}
    args = ", ".join(names[p] for p in emulation.parameters(body))
    main = (_GATED_MAIN if gated else _MAIN).replace("ARGS", args).replace(
        "    std::vector<E> out(", '    auto nw = load<E>("nw.bin", (size_t)K);\n    std::vector<E> out(')
    program = emulation.PRELUDE + f"using E = {emulation.HOST_TYPES[name]};\n" + body + main
    files = [("x", h.view(mx.uint16)), ("nw", nw.view(mx.uint16))]
    for suffix, (wq, sc, bi) in zip(("", "2"), layers):
        files += [(f"w{suffix}", wq), (f"s{suffix}", sc.view(mx.uint16)), (f"b{suffix}", bi.view(mx.uint16))]
    for file, a in files:
        (tmp_path / f"{file}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [1, k, n, group, bits, config[0], config[1], _tiles(config),
                                                  _split(config)])
    got = mx.array(np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16).reshape(1, n)).view(dtype)

    normed = mx.fast.rms_norm(h, nw, eps)
    h32 = h.astype(mx.float32)
    normed32 = h32 * mx.rsqrt(mx.mean(h32 * h32, axis=-1, keepdims=True) + eps) * nw.astype(mx.float32)
    products = [mx.quantized_matmul(normed, *layer, transpose=True, group_size=group, bits=bits) for layer in layers]
    exacts = [exact_product(normed32, *layer, group, bits) for layer in layers]
    if gated:
        want, exact = swiglu(*products), exacts[0] * mx.sigmoid(exacts[0]) * exacts[1]
    else:
        want, exact = products[0], exacts[0]
    assert agrees(got, want, exact)
    unnormed = [mx.quantized_matmul(h, *layer, transpose=True, group_size=group, bits=bits) for layer in layers]
    assert not agrees(swiglu(*unnormed) if gated else unnormed[0], want, exact)  # the norm is not a no-op here
    assert mx.abs(got.astype(mx.float32)).max().item() > 0


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "sizes", "config", "form"), [
    (4, (10, 3, 3), (4, 2), "x"), (4, (12, 4), (4, 4, 1, 2), "x"), (4, (10, 3, 3), (8, 2, 1, 1, 0, 4), "x"),
    (4, (10, 3, 3), (2, 4, 1, 1, 0, 1, 4), "x"), (4, (10, 3, 3), (8, 1), "prepared"), (6, (12, 4), (4, 4), "prepared"),
    (4, (12, 4), (4, 2), "q8"), (4, (10, 3, 3), (8, 2, 1, 1, 0, 4), "q8"), (4, (12, 4), (16, 4, 1, 1, 0, 4), "q8")])
def test_the_norm_folded_into_the_parts_source_is_mlx_norm_then_each_product(
        tmp_path, monkeypatch: pytest.MonkeyPatch, bits: int, sizes: tuple[int, ...], config, form: str) -> None:
    """The parts source (an attention's queries, keys and values) with the norm before it
    folded in, x made by each warp, prepared once a block, or rounded to bytes once a
    block (``q8``, K split between warps or not): each layer's output as close to a
    float32 norm and product as MLX's norm then product are (rounded: within
    :data:`qgemv_q8.TOLERANCE`)."""
    dtype, k, group, eps = mx.float16, _width(config, 32), 32, 1e-5
    mx.random.seed(bits + len(sizes))
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits) for n in sizes]
    h = (mx.random.normal((1, k)) * 5 - 1).astype(dtype)
    nw = (mx.random.uniform(shape=(k,)) + 0.5).astype(dtype)
    monkeypatch.setenv(qgemv_prepared.ENV, "all" if form == "prepared" else "0")  # (1: the gated products alone)
    monkeypatch.setenv(qgemv_q8.ENV, "1" if form == "q8" else "0")
    made = _made(dtype, bits, group, config, parts=sizes, k=k, eps=eps)
    assert ("_p_" in made["name"]) == (form == "prepared") and ("_q8_" in made["name"]) == (form == "q8")
    assert made["input_names"][-1] == "nw"
    suffix = ["", "2", "3"][:len(sizes)]
    body = emulation.function(made, ["float16", *(["uint32", "float16", "float16"] * len(sizes)), "float16"],
                              ["float16"] * len(sizes))
    names = {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w_shape": "ws", "nw": "nw.data()"}
    for i, sfx in enumerate(suffix):
        names |= {f"w{sfx}": f"w{sfx}.data()", f"scales{sfx}": f"s{sfx}.data()", f"biases{sfx}": f"b{sfx}.data()",
                  f"out{sfx}": f"out{sfx}.data()"}
    args = ", ".join(names[p] for p in emulation.parameters(body))
    loads = [f'auto w{x} = load<uint32_t>("w{x}.bin", (size_t)N{i} * K / 32 * BITS_); '
             f'auto s{x} = load<E>("s{x}.bin", (size_t)N{i} * K / G_); auto b{x} = load<E>("b{x}.bin", (size_t)N{i} * K / G_); '
             f"std::vector<E> out{x}(N{i});" for i, x in enumerate(suffix)]
    sizes_c = " ".join(f"const int N{i} = {n};" for i, n in enumerate(sizes))
    main = f"""
int main(int argc, char** argv) {{
    const int K = std::atoi(argv[2]), N = std::atoi(argv[3]), G_ = std::atoi(argv[4]), BITS_ = std::atoi(argv[5]);
    const int warps = std::atoi(argv[6]), rpw = std::atoi(argv[7]), split = std::atoi(argv[9]);
    {sizes_c}
    auto x = load<E>("x.bin", (size_t)K);
    auto nw = load<E>("nw.bin", (size_t)K);
    {" ".join(loads)}
    Shape xs{{1, K}}, ws{{N0, K / 32 * BITS_}};
    const int blocks = (N + warps / split * rpw - 1) / (warps / split * rpw);
    run_blocks(blocks, 32 * warps, [&] {{ kernel({args}); }});
    {" ".join(f'save("out{x}.bin", out{x});' for x in suffix)}
}}
"""
    program = emulation.PRELUDE + "using E = __half;\n" + body + main
    (tmp_path / "x.bin").write_bytes(np.array(h.view(mx.uint16)).tobytes())
    (tmp_path / "nw.bin").write_bytes(np.array(nw.view(mx.uint16)).tobytes())
    for sfx, (wq, sc, bi) in zip(suffix, layers):
        for name, a in ((f"w{sfx}", wq), (f"s{sfx}", sc.view(mx.uint16)), (f"b{sfx}", bi.view(mx.uint16))):
            (tmp_path / f"{name}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [1, k, sum(sizes), group, bits, config[0], config[1], 0,
                                                  _split(config)])
    normed = mx.fast.rms_norm(h, nw, eps)
    h32 = h.astype(mx.float32)
    normed32 = h32 * mx.rsqrt(mx.mean(h32 * h32, axis=-1, keepdims=True) + eps) * nw.astype(mx.float32)
    for sfx, n, layer in zip(suffix, sizes, layers):
        got = mx.array(np.frombuffer((tmp_path / f"out{sfx}.bin").read_bytes(), dtype=np.uint16).reshape(1, n)).view(dtype)
        want = mx.quantized_matmul(normed, *layer, transpose=True, group_size=group, bits=bits)
        assert agrees(got, want, exact_product(normed32, *layer, group, bits), qgemv_q8.tolerance(bits)), \
            f"part {sfx or 1}"
