"""The 4-bit one-row sums in half pairs (``GMLX_HALF2=1``, :mod:`qgemv_half2`): which kernels
take them, and each source that does run on the CPU (CUDA's half pair instructions as
the toolkit's headers give them on the host, the multiply-add rounded once) against
MLX's product, as closely as MLX's own is to a float32 one; a chunk's half sums
stay in half's range for any half x."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import qgemv_half2
from gmlx.engine.kernels.timing import agrees, exact_product
from tests.engine.kernels import emulation
from tests.engine.kernels import test_qgemv_cuda as base
from tests.engine.kernels import test_qkv_mixed as mixed


@pytest.fixture
def half2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(qgemv_half2.ENV, "1")


def test_only_float16_kernels_asked_for_it_take_half_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On for float16 layouts with ``GMLX_HALF2=1`` only (bfloat16's 8-bit mantissa would
    round the codes' products); the kernel's name follows its source, so a half-pair
    kernel never meets a float one's compiled code; 6- and 8-bit layouts keep the float
    sums (``H2`` is the 4-bit layouts' alone)."""
    monkeypatch.delenv(qgemv_half2.ENV, raising=False)
    off = base._made(mx.float16, 4, 32, (4, 2))
    monkeypatch.setenv(qgemv_half2.ENV, "1")
    on = base._made(mx.float16, 4, 32, (4, 2))
    assert "HALF2 = false" in off["source"] and "HALF2 = true" in on["source"]
    assert off["name"] != on["name"]
    assert "HALF2 = false" in base._made(mx.bfloat16, 4, 32, (4, 2))["source"]
    assert "constexpr bool H2 = HALF2 && BITS == 4;" in base._made(mx.float16, 6, 32, (4, 2))["source"]


def _plain(tmp_path, dtype, bits: int, group: int, config: tuple[int, ...], x, wq, s, b) -> mx.array:
    """The plain one-row source of ``config`` run on the CPU on ``x`` (one row)."""
    k, n = x.shape[-1], wq.shape[0]
    made = base._made(dtype, bits, group, config, k=k)
    assert "HALF2 = true" in made["source"]
    body = emulation.function(made, ["float16", "uint32", "float16", "float16"], "float16")
    args = ", ".join({"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w": "w.data()", "w_shape": "ws",
                      "scales": "s.data()", "biases": "b.data()", "out": "out.data()"}[name]
                     for name in emulation.parameters(body))
    program = emulation.PRELUDE + "using E = __half;\n" + body + base._MAIN.replace("ARGS", args)
    for name, a in (("x", x.view(mx.uint16)), ("w", wq), ("s", s.view(mx.uint16)), ("b", b.view(mx.uint16))):
        (tmp_path / f"{name}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [1, k, n, group, bits, config[0], config[1], base._tiles(config),
                                                  base._split(config)])
    return mx.array(np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint16).reshape(1, n)).view(dtype)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("group", "config"), [(32, (4, 2)), (64, (4, 4, 1, 2)), (128, (8, 1, 1, 3)),
                                               (32, (2, 2, 1, 1, 2)), (32, (4, 2, 1, 1, 0, 4))])
def test_the_plain_sources_in_half_pairs_are_mlx_product(tmp_path, half2, group: int, config) -> None:
    """The one-row source at depths 1-3, staged and split, in half pairs: 12 weight rows of
    1,088 values (2,176 split), x of a large spread (values to ~12), as close to the
    float32 product as MLX's float16 product is."""
    dtype = mx.float16
    k = 2176 if base._split(config) > 1 else 1088 if group != 128 else 1152
    mx.random.seed(group + config[0])
    wq, s, b = mx.quantize(mx.random.normal((12, k)).astype(dtype), group_size=group, bits=4)
    x = (mx.random.normal((1, k)) * 3).astype(dtype)
    got = _plain(tmp_path, dtype, 4, group, config, x, wq, s, b)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=4)
    assert agrees(got, want, exact_product(x, wq, s, b, group, 4))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
def test_x_near_the_top_of_half_range_keeps_every_sum_in_it(tmp_path, half2) -> None:
    """x to ~45,000 (half's largest is 65,504) against small weights: the product is
    ~700, and a chunk's half sums (eight codes' ``q / 256 x`` a pair; as ``q / 16 x`` they
    would pass 65,504) stay in half's range, so the product is MLX's."""
    dtype = mx.float16
    mx.random.seed(7)
    wq, s, b = mx.quantize((mx.random.normal((12, 1088)) * 1e-3).astype(dtype), group_size=32, bits=4)
    x = (mx.random.normal((1, 1088)) * 12000).astype(dtype)
    got = _plain(tmp_path, dtype, 4, 32, (4, 2), x, wq, s, b)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=4)
    assert mx.isinf(want).sum().item() == 0 and mx.isinf(got).sum().item() == 0
    assert agrees(got, want, exact_product(x, wq, s, b, 32, 4))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("config", "gated"), [((4, 4, 1), True), ((4, 2), False), ((8, 4, 1, 1, 0, 2), True)])
def test_the_normed_sources_in_half_pairs_are_mlx_norm_then_product(tmp_path, monkeypatch: pytest.MonkeyPatch, half2,
                                                                    config, gated: bool) -> None:
    """The norm folded in (the hidden state times the norm's weight in half pairs, the
    scale taken last), plain, gated and split: as close to a float32 norm and product as
    MLX's norm then product are."""
    base.test_the_norm_folded_into_the_one_row_source_is_mlx_norm_then_product(tmp_path, monkeypatch, 4, 32, config,
                                                                               gated, mx.float16, False)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("config", [(4, 2), (8, 2, 1, 1, 0, 4)])
def test_the_normed_parts_in_half_pairs_are_each_layers_product(tmp_path, monkeypatch: pytest.MonkeyPatch, half2,
                                                                config) -> None:
    base.test_the_norm_folded_into_the_parts_source_is_mlx_norm_then_each_product(tmp_path, monkeypatch, 4, (10, 3, 3),
                                                                                  config, False)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
def test_the_mixed_qkv_takes_half_pairs_for_its_4_bit_part_alone(tmp_path, half2) -> None:
    """The mixed q-k-v kernel (4-bit queries and keys, 6-bit values): the 4-bit scope sums
    in half pairs, the 6-bit one in floats, each part MLX's norm then product."""
    assert "HALF2 = true" in mixed._made(mx.float16, (4, 32), (6, 32), (4, 2), (12, 4), 6, 1e-5)["source"]
    mixed.test_each_part_is_mlx_norm_then_its_layers_product(tmp_path, (4, 32), (6, 32), (12, 4), 6, (4, 2))
