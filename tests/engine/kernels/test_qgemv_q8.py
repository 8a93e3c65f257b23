"""The one-row 4-bit products with x rounded to bytes once a block (``GMLX_Q8X=1``,
:mod:`qgemv_q8`): which products and shapes take the source, the ones it refuses, and the
source itself run on the CPU (each warp as 32 host threads, ``__dp4a`` emulated) against
two references: the float32 product of x rounded as the source says it rounds it (to
within float sums' rounding: the integer sums are exact), and MLX's own product within
:data:`qgemv_q8.TOLERANCE`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import qgemv_cuda, qgemv_prepared, qgemv_q8
from gmlx.engine.kernels.timing import agrees, exact_product
from tests.engine.kernels import emulation
from tests.engine.kernels.test_qgemv_cuda import _GATED_MAIN, _MAIN, _STACKED_GATED_MAIN, _made


def test_it_is_the_default_and_gmlx_q8x_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(qgemv_q8.ENV)
    assert qgemv_q8.q8x() and "_q8_" in _made(mx.float16, 4, 32, (4, 4, 1), gated=True, k=4096, eps=1e-5)["name"]
    assert qgemv_q8.rounds(6) and "_q8_" in _made(mx.float16, 6, 32, (4, 2), k=14336, residual=True)["name"]
    monkeypatch.setenv(qgemv_q8.ENV, "1")  # the 4-bit products alone
    assert qgemv_q8.rounds(4) and not qgemv_q8.rounds(6)
    monkeypatch.setenv(qgemv_q8.ENV, "0")
    assert not qgemv_q8.q8x()
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 4, 1), gated=True, k=4096, eps=1e-5)["name"]


def test_only_4_bit_one_row_unstaged_products_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(qgemv_q8.ENV, "1")
    monkeypatch.setenv(qgemv_prepared.ENV, "all")  # rounding x to bytes takes the place of x prepared
    for kw in ({"gated": True, "eps": 1e-5}, {"parts": (4096, 1024, 1024), "eps": 1e-5}, {"residual": True}, {}):
        made = _made(mx.float16, 4, 32, (4, 2), k=4096, **kw)
        assert "_q8_" in made["name"] and "_p_" not in made["name"] and "__dp4a" in made["source"], kw
        assert ("nw" in made["input_names"]) == ("eps" in kw)
    assert "_q8_" not in _made(mx.float16, 6, 32, (4, 2), k=4096)["name"]  # 6- and 8-bit codes: float sums
    assert "_q8_" not in _made(mx.float16, 8, 32, (4, 2), k=4096)["name"]
    monkeypatch.setenv(qgemv_q8.ENV, "all")  # 6-bit ones too
    assert "_q8_" in _made(mx.float16, 6, 32, (4, 2), k=4096)["name"]
    assert "_q8_" not in _made(mx.float16, 8, 32, (4, 2), k=4096)["name"]
    assert qgemv_q8.tolerance(6) == qgemv_q8.TOLERANCE and qgemv_q8.tolerance(8) == 1e-3
    monkeypatch.setenv(qgemv_q8.ENV, "1")
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 2, 1, 2), k=4096)["name"]  # depth 2
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 2, 4), k=4096)["name"]  # four rows of x
    assert "_s4_q8_" in _made(mx.float16, 4, 32, (4, 2, 1, 1, 0, 4), k=4096)["name"]  # K split, a chunk a lane
    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "1")
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 2, 1, 2, 0, 2), k=4096)["name"]  # K split, depth 2
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 2), k=65536)["name"]  # x's bytes over 48 KB
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 2))["name"]  # no width given


def test_shapes_and_widths_the_source_refuses() -> None:
    for kind in ({"max_rows": 2}, {"tiles": 1}, {"split": 2, "depth": 2}, {"rounds": 4}, {"prepared": True}):
        with pytest.raises(ValueError, match="rounded to bytes"):
            qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=4096, q8=True, **kind)
    with pytest.raises(ValueError, match="rounded to bytes"):
        qgemv_cuda._kernel(mx.float16, 8, 32, 4, 2, k=4096, q8=True)
    with pytest.raises(ValueError, match="not rounded"):
        qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=49152, q8=True)


def test_shared_memory_of_a_row() -> None:
    """A byte a value, a step and a sum a chunk, a float a warp: an 8B's down product
    (14,336 values) takes 17.9 KB; 32,768 fit, 40,960 do not."""
    assert qgemv_q8.shared_bytes(14336, 4) == 14336 + 8 * 448 + 16
    assert qgemv_q8.fits(32768, 8) and not qgemv_q8.fits(40960, 4)
    assert qgemv_q8.shared_bytes(14336, 8, split_rows=4) == 14336 + 8 * 448 + 32 + 8 * 5 * 4  # and the warps' sums
    assert qgemv_q8.fits(39200, 4) and not qgemv_q8.fits(39200, 16, split_rows=4)


def rounded(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, one row) as the source rounds it: each chunk of 32 values to the
    nearest multiple of its largest magnitude / 127, ties to even."""
    chunks = x.reshape(-1, 32).astype(np.float32)
    most = np.abs(chunks).max(axis=1, keepdims=True)
    inv = np.where(most > 0, np.float32(127) / np.where(most > 0, most, 1), 0).astype(np.float32)
    return (np.rint(chunks * inv) * (most / np.float32(127))).reshape(x.shape).astype(np.float32)


def _run(tmp_path, made: dict, dtype, group: int, layers: list, h: mx.array, nw: mx.array | None,
         config: tuple[int, ...], bits: int = 4, stacked: bool = False) -> mx.array:
    """The source of ``made`` run on the CPU over one row ``h`` (with the norm's weight
    ``nw`` where it is folded in); ``layers``: one layer's, or the gate's and the up's,
    weights, scales and biases (with ``stacked``, handed over as one array each)."""
    name = str(dtype).removeprefix("mlx.core.")
    gated = len(layers) == 2
    arrays = [tuple(mx.concatenate([layer[j] for layer in layers]) for j in range(3))] if stacked else layers
    types = [name, *(["uint32", name, name] * len(arrays)), *([name] if nw is not None else [])]
    body = emulation.function(made, types, name)
    names = {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w": "w.data()", "w_shape": "ws", "scales": "s.data()",
             "biases": "b.data()", "w2": "w2.data()", "scales2": "s2.data()", "biases2": "b2.data()",
             "nw": "nw.data()", "out": "out.data()"}
    main = (_STACKED_GATED_MAIN if stacked else _GATED_MAIN if gated else _MAIN).replace("ARGS", ", ".join(names[p] for p in emulation.parameters(body)))
    if nw is not None:
        main = main.replace("    std::vector<E> out(", '    auto nw = load<E>("nw.bin", (size_t)K);\n    std::vector<E> out(')
    files = [("x", h.view(mx.uint16))] + ([("nw", nw.view(mx.uint16))] if nw is not None else [])
    for suffix, (wq, sc, bi) in zip(("", "2"), arrays):
        files += [(f"w{suffix}", wq), (f"s{suffix}", sc.view(mx.uint16)), (f"b{suffix}", bi.view(mx.uint16))]
    for file, a in files:
        (tmp_path / f"{file}.bin").write_bytes(np.array(a).tobytes())
    k, n = h.shape[-1], layers[0][0].shape[0]
    program = emulation.PRELUDE + f"using E = {emulation.HOST_TYPES[name]};\n" + body + main
    emulation.compile_and_run(tmp_path, program, [1, k, n, group, bits, config[0], config[1], 0,
                                                  qgemv_cuda.launch_shape(config)[5]])
    return mx.array(np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16).reshape(1, n)).view(dtype)


def reference(x: mx.array, layer: tuple, group: int, bits: int = 4) -> mx.array:
    """The float32 product the source computes: the codes' part against x rounded
    (:func:`rounded`), the biases' part against x itself (each chunk's float sum)."""
    wq, scales, biases = (a.astype(mx.float32) if a.dtype != mx.uint32 else a for a in layer)  # weights unrounded
    x = x.astype(mx.float32)
    kept = mx.array(rounded(np.array(x)))
    return (exact_product(kept, wq, scales, biases, group, bits)
            + exact_product(x - kept, wq, 0 * scales, biases, group, bits))


def _close(got: mx.array, ref: mx.array) -> bool:
    """``got`` within its float16 or bfloat16 roundings (the products', the swiglu's: a few
    units in the last place) of ``ref``, and 0.1% of the largest output (a swiglu's
    exponential tail, or one of x's values rounded the other way by a norm summed in
    another order: a step times a weight)."""
    rel = 4e-3 if got.dtype == mx.float16 else 2e-2
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(got - ref) <= rel * mx.abs(ref) + 1e-3 * mx.abs(ref).max()).all().item()


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("bits", "group", "config", "dtype", "k"), [
    (4, 32, (4, 2), mx.float16, 1088), (4, 64, (4, 4), mx.bfloat16, 1088), (4, 128, (8, 1), mx.float16, 4096),
    (6, 32, (4, 4), mx.float16, 1088), (6, 64, (8, 1), mx.bfloat16, 1088),
    (4, 32, (4, 2, 1, 2), mx.float16, 1088), (4, 64, (4, 4, 1, 4), mx.bfloat16, 4096),
    (4, 32, (8, 2, 1, 4), mx.float16, 4160), (6, 32, (4, 2, 1, 2), mx.float16, 4160),
    (4, 32, (4, 4, 1, 1, 0, 4), mx.float16, 2176), (4, 64, (16, 4, 1, 1, 0, 4), mx.bfloat16, 2176),
    (6, 32, (8, 4, 1, 1, 0, 2), mx.float16, 4160), (4, 128, (8, 2, 1, 1, 0, 4), mx.float16, 4096)])
def test_the_source_is_the_product_of_x_rounded_and_near_mlx_product(
        tmp_path, monkeypatch: pytest.MonkeyPatch, bits: int, group: int, config, dtype, k: int) -> None:
    """A plain product of 4- or 6-bit codes (``GMLX_Q8X=all``) over 1,088 values (lanes
    with one chunk and with two) or 4,096 (four each), 12 weight rows (a block's last warp past the end): the float32 product of x
    rounded as :func:`rounded` says (the biases' part of x itself: :func:`reference`),
    and within :data:`qgemv_q8.TOLERANCE` of MLX's product, though in float16 not within
    MLX's own distance from a float32 product (x's rounding shows). With several chunks a
    lane in flight (``GMLX_Q8_DEPTH=1``): 1,088 values at depth 2 (two lanes with a second
    chunk), 4,096 at depth 4 (a lane's whole row in one group), 4,160 at 4 and 2 (two
    lanes with a second group of one chunk, or a third). With K split between warps
    (``GMLX_SPLIT_K=1``, :func:`qgemv_split.split_rounded`): 2,176 values split four ways
    (a group's third warp with 4 lanes' chunks, its fourth none; at 16 warps a block's
    last group wholly past the end), 4,160 two ways (6-bit), 4,096 four ways (one chunk a
    lane each)."""
    monkeypatch.setenv(qgemv_q8.ENV, "1" if bits == 4 else "all")
    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "1")
    n = 12
    mx.random.seed(group + k + bits - 4)
    layer = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=bits)
    x = (mx.random.normal((1, k)) * 3).astype(dtype)
    made = _made(dtype, bits, group, config, k=k)
    depth, split = qgemv_cuda.launch_shape(config)[3], qgemv_cuda.launch_shape(config)[5]
    assert "_q8_" in made["name"] and (f"_d{depth}_" in made["name"]) == (depth > 1)
    assert (f"_s{split}_" in made["name"]) == (split > 1)
    got = _run(tmp_path, made, dtype, group, [layer], x, None, config, bits)
    ref = reference(x, layer, group, bits)
    assert _close(got, ref)
    want = mx.quantized_matmul(x, *layer, transpose=True, group_size=group, bits=bits)
    exact = exact_product(x, *layer, group, bits)
    assert agrees(got, want, exact, qgemv_q8.tolerance(bits))  # what a load allows it
    if dtype == mx.float16 and k <= 4096:  # rounded: not within MLX's own distance (bfloat16's output rounding
        # is wider; at 4,160 values these rows' float16 sums put MLX's own up to 1.4% off, wide enough for x's)
        assert not agrees(got, want, exact, 1e-3)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("config", "gated", "dtype", "stacked"), [
    ((4, 4, 1), True, mx.float16, False), ((4, 2, 1), True, mx.bfloat16, False), ((8, 4, 1), True, mx.float16, False),
    ((4, 2), False, mx.float16, False), ((4, 2, 1, 4), True, mx.float16, False), ((4, 4, 1, 2), False, mx.bfloat16, False),
    ((4, 4, 1, 1, 0, 4), True, mx.float16, False), ((8, 2, 1, 1, 0, 2), False, mx.bfloat16, False),
    ((4, 4, 1), True, mx.float16, True), ((4, 4, 1, 1, 0, 4), True, mx.bfloat16, True)])
def test_the_norm_folded_in_is_mlx_norm_then_product_within_the_tolerance(
        tmp_path, monkeypatch: pytest.MonkeyPatch, config, gated: bool, dtype, stacked: bool) -> None:
    """The norm folded in (gated: the MLP's gate-up-swiglu), 1,088 values, 75 output rows:
    the float32 norm and product of the normed row rounded as :func:`rounded` says (and
    its swiglu), and within :data:`qgemv_q8.TOLERANCE` of MLX's norm, products and swiglu;
    with K split between warps too (their sums met before the norm's scale); the gate's and
    up's weights apart or stacked into one array each (:mod:`stacked`, as one stream's
    default source reads them where a load stacked them)."""
    from mlx_lm.models.activations import swiglu

    monkeypatch.setenv(qgemv_q8.ENV, "1")
    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "1")  # (a depth past 1 rounds only so)
    k, n, group, eps = 1088, 75, 32, 1e-5
    mx.random.seed(7 + gated)
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=group, bits=4)
              for _ in range(2 if gated else 1)]
    h = (mx.random.normal((1, k)) * 7 + 2).astype(dtype)  # far from unit RMS: the scale shows
    nw = (mx.random.uniform(shape=(k,)) + 0.5).astype(dtype)
    made = _made(dtype, 4, group, config, gated=gated, k=k, eps=eps, stacked=stacked)
    assert "_q8_" in made["name"] and made["input_names"][-1] == "nw"
    got = _run(tmp_path, made, dtype, group, layers, h, nw, config, stacked=stacked)

    h32 = h.astype(mx.float32)
    normed32 = h32 * mx.rsqrt(mx.mean(h32 * h32, axis=-1, keepdims=True) + eps) * nw.astype(mx.float32)
    refs = [reference(normed32, layer, group) for layer in layers]
    ref = refs[0] * mx.sigmoid(refs[0]) * refs[1] if gated else refs[0]
    assert _close(got, ref)
    normed = mx.fast.rms_norm(h, nw, eps)
    products = [mx.quantized_matmul(normed, *layer, transpose=True, group_size=group, bits=4) for layer in layers]
    exacts = [exact_product(normed32, *layer, group, 4) for layer in layers]
    want = swiglu(*products) if gated else products[0]
    exact = exacts[0] * mx.sigmoid(exacts[0]) * exacts[1] if gated else exacts[0]
    assert agrees(got, want, exact, qgemv_q8.TOLERANCE)


def test_x_rounded_adds_under_the_tolerance_at_an_8b_width() -> None:
    """What :data:`qgemv_q8.TOLERANCE` is sized by: x's rounding alone (no kernel; the
    float32 products of a row and of it rounded) over the 8B's 4,096 and 14,336 values,
    256 rows of random 4-bit weights, a row of normal values and one with a few large ones
    (as a hidden state has): the largest difference is under a third of the tolerance of
    the largest output for the normal rows (measured 0.5-0.8%: x's step is ~1/60 of its
    RMS, so the difference is ~1/200 of the output's), and under half with spikes
    (0.8-1.3%: a chunk's step is its largest value's, so a spike coarsens its 31
    neighbours; llama.cpp's 8-bit x has the same bound)."""
    for k, seed in ((4096, 1), (14336, 2)):
        mx.random.seed(seed)
        layer = mx.quantize(mx.random.normal((256, k)).astype(mx.float16), group_size=32, bits=4)
        x = mx.random.normal((1, k))
        spiky = x + (mx.random.uniform(shape=(1, k)) > 0.995) * 40  # ~0.5% of the values large
        for row, bound in ((x, qgemv_q8.TOLERANCE / 3), (spiky, qgemv_q8.TOLERANCE / 2)):
            exact = exact_product(row, *layer, 32, 4)
            kept = exact_product(mx.array(rounded(np.array(row))), *layer, 32, 4)
            worst = (mx.abs(kept - exact).max() / mx.abs(exact).max()).item()
            assert 0 < worst < bound, (k, worst)


def test_a_load_allows_the_tolerance_only_where_x_may_be_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loads' agreement checks hold a one-row 4- or 6-bit product (by default: x
    rounded for both) to twice MLX's error plus :data:`qgemv_q8.TOLERANCE` of the largest
    output, every other product (8-bit, more rows, 6-bit with ``GMLX_Q8X=1``, any with
    ``GMLX_Q8X=0``) to MLX's 0.1%: a product 1% off passes only there."""
    exact = mx.array([100.0, -50.0, 3.0])
    want, got = exact + 0.01, exact + mx.array([1.0, 0.0, 0.0])
    monkeypatch.delenv(qgemv_q8.ENV)
    for bits in (4, 6):
        assert agrees(got, want, exact, qgemv_q8.tolerance(bits)), bits
        assert not agrees(exact + 4.0, want, exact, qgemv_q8.tolerance(bits)), bits
    for bits, rows in ((8, 1), (4, 2), (6, 2)):
        assert not agrees(got, want, exact, qgemv_q8.tolerance(bits, rows)), (bits, rows)
    assert not agrees(got, want, exact)
    monkeypatch.setenv(qgemv_q8.ENV, "1")  # the 4-bit products alone
    assert agrees(got, want, exact, qgemv_q8.tolerance(4)) and not agrees(got, want, exact, qgemv_q8.tolerance(6))
    monkeypatch.setenv(qgemv_q8.ENV, "0")
    assert not agrees(got, want, exact, qgemv_q8.tolerance(4))


def test_the_gated_shapes_of_8_warps_are_timed_only_where_x_is_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(qgemv_q8.ENV, "0")
    assert not set(qgemv_q8.GATED) & set(qgemv_cuda.gated_configs(1, 4096))
    monkeypatch.setenv(qgemv_q8.ENV, "1")
    assert set(qgemv_q8.GATED) <= set(qgemv_cuda.gated_configs(1, 4096))
    assert qgemv_cuda.gated_configs(1, 4096)[0] == (4, 4, 1)  # the default stays first
    assert "_q8_" in _made(mx.float16, 4, 32, qgemv_q8.GATED[0], gated=True, k=4096, eps=1e-5)["name"]


def test_deeper_shapes_round_and_are_timed_only_with_gmlx_q8_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GMLX_Q8_DEPTH`` (on by default since 12-07): the depth-2 shapes round x too and
    :data:`qgemv_q8.DEEP` is timed beside the others, every choice kept under ``:deep``;
    with ``GMLX_Q8_DEPTH=0`` neither, and the keys are as before."""
    monkeypatch.setenv(qgemv_q8.ENV, "1")
    monkeypatch.delenv(qgemv_q8.DEEP_ENV)
    assert qgemv_q8.deep() and qgemv_q8.key(4) == ":q8:deep"  # the default
    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "0")
    assert not set(qgemv_q8.DEEP) & set(qgemv_cuda.configs(1, 4096) + qgemv_cuda.gated_configs(1, 4096))
    assert "_q8_" not in _made(mx.float16, 4, 32, (4, 4, 1, 2), gated=True, k=4096, eps=1e-5)["name"]
    assert qgemv_q8.key(4) == ":q8" and qgemv_q8.key(6) == ""
    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "1")
    assert set(qgemv_q8.DEEP) <= set(qgemv_cuda.configs(1, 4096)) and set(qgemv_q8.DEEP) <= set(
        qgemv_cuda.gated_configs(1, 4096))
    assert qgemv_cuda.configs(1, 4096)[0] == (4, 2) and qgemv_cuda.gated_configs(1, 4096)[0] == (4, 4, 1)
    made = _made(mx.float16, 4, 32, (4, 4, 1, 2), gated=True, k=4096, eps=1e-5)
    assert "_d2_q8_" in made["name"] and "__dp4a" in made["source"] and "qn[DEPTH]" in made["source"]
    assert "_q8_" not in _made(mx.float16, 6, 32, (4, 2, 1, 4), k=4096)["name"]  # 6-bit: float sums unless all
    assert qgemv_q8.key(4) == ":q8:deep" and qgemv_q8.key(6) == ":deep"
    assert (4, 4, 1, 4) in qgemv_cuda.configs(1, 4096) and (4, 4, 1, 4) not in qgemv_cuda.configs(1, 14336)
    assert (4, 2, 1, 4) in qgemv_cuda.configs(1, 14336)  # (its registers fit at any width)
