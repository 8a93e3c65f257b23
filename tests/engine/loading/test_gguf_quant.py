"""Every GGML -> MLX mapping against the gguf package's reference dequantization."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from gmlx.engine.loading import gguf_quant
from gmlx.engine.loading.gguf_quant import QuantizedTensor

Q = GGMLQuantizationType
ROWS, COLS = 8, 512
Blocks = Callable[..., np.ndarray]  # conftest.random_blocks: (qtype, rows, cols, seed=0)


def mlx_values(t: QuantizedTensor) -> np.ndarray:
    w = mx.dequantize(t.weight, t.scales, t.biases, group_size=t.group_size, bits=t.bits)
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_matches_mlx_layout(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(4, 128), dtype=np.uint8)
    packed = mx.array(gguf_quant.pack_codes(codes, bits))
    ones, zeros = mx.ones((4, 4)), mx.zeros((4, 4))
    back = mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(back), codes)


@pytest.mark.parametrize("qtype", gguf_quant.EXACT_TYPES, ids=lambda t: t.name)
def test_exact_types_are_lossless(qtype: GGMLQuantizationType, make_blocks: Blocks) -> None:
    raw = make_blocks(qtype, ROWS, COLS)
    reference = gguf_quants.dequantize(raw, qtype)
    t = gguf_quant.convert(raw, qtype, mx.float32)
    assert isinstance(t, QuantizedTensor) and t.group_size == 32 and t.max_error is None
    # float32 scales: equal up to the rounding of one multiply-add.
    np.testing.assert_allclose(mlx_values(t), reference, rtol=1e-6, atol=1e-7)
    # float16 scales (what models use): K-quant products d*sc round once in fp16.
    t16 = gguf_quant.convert(raw, qtype, mx.float16)
    bound = 2e-3 * np.abs(reference).max()
    assert np.abs(mlx_values(t16) - reference).max() <= bound


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_exact_types_from_quantized_weights(qtype: GGMLQuantizationType) -> None:
    """Blocks made by the gguf package's own quantizer (realistic scales)."""
    w = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = gguf_quants.quantize(w, qtype)
    reference = gguf_quants.dequantize(raw, qtype)
    assert np.array_equal(mlx_values(gguf_quant.convert(raw, qtype, mx.float32)), reference)
    # In float16 the dequantized value itself is rounded: within 2 ulp of the largest.
    t16 = gguf_quant.convert(raw, qtype, mx.float16)
    assert np.abs(mlx_values(t16) - reference).max() <= 2 * 2**-10 * np.abs(reference).max()


def test_exact_bits(make_blocks: Blocks) -> None:
    expected = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5}
    for qtype, bits in expected.items():
        t = gguf_quant.convert(make_blocks(qtype, 2, 256), qtype, mx.float32)
        assert isinstance(t, QuantizedTensor) and t.bits == bits


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q3_K, Q.Q2_K], ids=lambda t: t.name)
def test_requantized_types_within_stated_bound(
    qtype: GGMLQuantizationType, make_blocks: Blocks
) -> None:
    raw = make_blocks(qtype, ROWS, COLS)
    reference = gguf_quants.dequantize(raw, qtype)
    t = gguf_quant.convert(raw, qtype, mx.float32)
    assert isinstance(t, QuantizedTensor) and t.bits == gguf_quant.REQUANT_BITS[qtype]
    err = np.abs(mlx_values(t) - reference).max()
    assert t.max_error == pytest.approx(err, rel=1e-5)
    # Round to nearest over each 32-group's [min, max]: at most half a step.
    groups = reference.reshape(-1, 32)
    half_step = (groups.max(1) - groups.min(1)) / (2**t.bits - 1) / 2
    assert err <= half_step.max() * (1 + 1e-5)
    assert np.all(
        np.abs(mlx_values(t) - reference).reshape(-1, 32).max(1) <= half_step * (1 + 1e-5) + 1e-7
    )


def test_float_types_as_is() -> None:
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    f16 = gguf_quant.convert(w.astype(np.float16), Q.F16, mx.float16)
    assert np.array_equal(np.array(f16), w.astype(np.float16))
    bf16_bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    bf16 = gguf_quant.convert(bf16_bits, Q.BF16, mx.bfloat16)
    assert bf16.dtype == mx.bfloat16
    assert np.array_equal(
        np.array(bf16.astype(mx.float32)), gguf_quant.dequantize(bf16_bits, Q.BF16)
    )


def test_chunked_conversion_matches_unchunked(
    monkeypatch: pytest.MonkeyPatch, make_blocks: Blocks
) -> None:
    raw = make_blocks(Q.Q4_K, ROWS, COLS)
    whole = gguf_quant.convert(raw, Q.Q4_K, mx.float32)
    monkeypatch.setattr(gguf_quant, "_CHUNK_ELEMENTS", COLS * 3)  # uneven chunks
    monkeypatch.setattr(gguf_quant, "_EXACT_CHUNK_ELEMENTS", COLS * 3)  # Q4_K is exact: its own chunks
    chunked = gguf_quant.convert(raw, Q.Q4_K, mx.float32)
    assert np.array_equal(np.array(whole.weight), np.array(chunked.weight))
    assert np.array_equal(np.array(whole.scales), np.array(chunked.scales))


def test_the_fast_q6_k_dequantizer_gives_the_reference_bits(make_blocks: Blocks) -> None:
    """``q6_k_values`` (what requantization reads) against the ``gguf`` package's own
    dequantizer, bit for bit: random blocks, and ``d`` at the fp16 edges (zero, minus
    zero, subnormal, the largest finite, negative)."""
    raw = make_blocks(Q.Q6_K, 64, 768, seed=7)
    blocks = raw.reshape(-1, 210)
    edges = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, -1.5], np.float16)
    blocks[: len(edges), 208:210] = edges.view(np.uint8).reshape(-1, 2)
    want = gguf_quants.dequantize(raw, Q.Q6_K).astype(np.float32)
    got = gguf_quant.q6_k_values(raw).reshape(want.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
