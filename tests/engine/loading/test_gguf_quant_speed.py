"""The vectorized/threaded converters in ``gguf_quant`` against a frozen copy of the
previous single-threaded implementation: same bytes in weight, scales and biases, for
every supported type and scale dtype. ``benchmarks/convert_speed.py`` times both."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from conftest import random_blocks
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from gmlx.engine.loading import gguf_quant
from gmlx.engine.loading.gguf_quant import QuantizedTensor

Q = GGMLQuantizationType
GROUP = 32
_CHUNK_ELEMENTS = 1 << 22
FLOAT_TYPES = gguf_quant.FLOAT_TYPES
REQUANT_BITS = gguf_quant.REQUANT_BITS

# ---- frozen reference: gguf_quant.py before vectorization (do not optimize) ----------

# -- code extraction: GGML blocks -> (codes, scale, bias) per 32-element group --------


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block, as float32 column (N, 1)."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Split bytes (N, k, 16|32) into low nibbles then high nibbles along the last axis."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _low_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit i of a little-endian uint32 per block (N, 4 bytes) -> (N, n) of 0/1."""
    words = qh.copy().view(np.uint32)
    return ((words >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8.0 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    codes = _nibbles(b[:, 6:22]) | (_low_bits(b[:, 2:6], 32) << 4)
    return codes, d, -16.0 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes = _nibbles(b[:, 8:24]) | (_low_bits(b[:, 4:8], 32) << 4)
    return codes, _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128.0 * d


def k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs packed in the 12 ``scales`` bytes of Q4_K/Q5_K.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low
    nibbles of scales 4-7 and, in their high nibbles, the low nibbles of mins 4-7, whose
    top two bits are the top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = k_scales_mins(b[:, 4:16])
    return d * sc, -dmin * mn


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, bias = _k_affine(b)
    # 4 chunks of 32 bytes; within a chunk the low nibbles are sub-block 2c, high 2c+1.
    codes = _nibbles(b[:, 16:144].reshape(-1, 4, 32))
    return codes.reshape(len(b), 256), scale, bias


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, bias = _k_affine(b)
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).reshape(len(b), 256), scale, bias


_EXACT: dict[
    GGMLQuantizationType,
    tuple[int, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]],
] = {
    Q.Q4_0: (4, _q4_0),
    Q.Q4_1: (4, _q4_1),
    Q.Q5_0: (5, _q5_0),
    Q.Q5_1: (5, _q5_1),
    Q.Q8_0: (8, _q8_0),
    Q.Q4_K: (4, _q4_k),
    Q.Q5_K: (5, _q5_k),
}
EXACT_TYPES = tuple(_EXACT)
SUPPORTED_TYPES = (*FLOAT_TYPES, *EXACT_TYPES, *REQUANT_BITS)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes (rows, n) into MLX's uint32 words (rows, n * bits / 32).

    Eight codes make ``bits`` bytes of the little-endian bit stream, so each run of 8
    is summed into a uint64 and its low ``bits`` bytes kept.
    """
    rows, n = codes.shape
    eight = codes.reshape(rows, n // 8, 8).astype(np.uint64)
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits))[None, None, :]
    words = np.bitwise_or.reduce(eight << shifts, axis=-1)
    stream = words[..., None].view(np.uint8).reshape(rows, n // 8, 8)[..., :bits]
    return np.ascontiguousarray(stream).reshape(rows, -1).view(np.uint32)


def _row_chunks(rows: int, cols: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def convert_exact(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, dtype: mx.Dtype
) -> QuantizedTensor:
    """Re-lay GGML blocks (rows, row_bytes) as MLX codes, scales and biases, losslessly.

    The codes are the GGUF's own integers; scales and biases are computed in float32
    and stored in ``dtype`` (float32 keeps them exact; float16 rounds K-quant products).
    """
    bits, decode = _EXACT[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), np.float32)
    biases = np.empty((rows, cols // GROUP), np.float32)
    for sl in _row_chunks(rows, cols):
        blocks = np.ascontiguousarray(raw[sl]).reshape(-1, size)
        codes, scale, bias = decode(blocks)
        n = sl.stop - sl.start
        weight[sl] = pack_codes(codes.reshape(n, cols), bits)
        # Per-block scales repeat over a block's 32-groups (Q4_0..Q8_0 have one group).
        per_block = block // GROUP
        scales[sl] = np.broadcast_to(scale, (len(blocks), per_block)).reshape(n, -1)
        biases[sl] = np.broadcast_to(bias, (len(blocks), per_block)).reshape(n, -1)
    return _quantized(weight, scales, biases, bits, dtype)


def _quantized(
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    dtype: mx.Dtype,
    max_error: float | None = None,
) -> QuantizedTensor:
    """Packed codes and float32 group scales/biases as MLX arrays (scales in ``dtype``)."""
    return QuantizedTensor(
        mx.array(weight),
        mx.array(scales).astype(dtype),
        mx.array(biases).astype(dtype),
        bits,
        GROUP,
        max_error=max_error,
    )


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float32 values of a GGML tensor by the ``gguf`` package's reference code."""
    if qtype == Q.BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return gguf_quants.dequantize(raw, qtype).astype(np.float32, copy=False)


def affine_quantize(
    w: np.ndarray, bits: int, dtype: mx.Dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Round-to-nearest affine quantization of float32 rows (rows, cols) at group 32.

    Each group's grid spans exactly its [min, max] (``mx.quantize`` instead keeps zero on
    the grid, which can cost more than half a step at the ends). Codes are computed from
    the scale and bias as stored in ``dtype``, so the error is at most half a step plus
    that rounding. Returns packed codes, scales, biases (float32) and the max error.
    """
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    levels = 2**bits - 1
    scale = np.where(hi > lo, (hi - lo) / levels, 1.0).astype(np.float32)
    stored = mx.array(np.stack([scale, lo])).astype(dtype).astype(mx.float32)
    scale, bias = (np.array(a) for a in stored)
    codes = np.clip(np.rint((g - bias[..., None]) / scale[..., None]), 0, levels)
    error = float(np.abs(codes * scale[..., None] + bias[..., None] - g).max(initial=0.0))
    packed = pack_codes(codes.astype(np.uint8).reshape(rows, cols), bits)
    return packed, scale, bias, error


def requantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, dtype: mx.Dtype, bits: int
) -> QuantizedTensor:
    """Dequantize (reference code) and requantize at group 32 and ``bits``.

    ``max_error`` is the largest absolute difference between the GGUF's values and the
    MLX ones (before any rounding of the dequantized output to ``dtype``).
    """
    rows = raw.shape[0]
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), np.float32)
    biases = np.empty((rows, cols // GROUP), np.float32)
    max_error = 0.0
    for sl in _row_chunks(rows, cols):
        w = dequantize(np.ascontiguousarray(raw[sl]), qtype).reshape(-1, cols)
        weight[sl], scales[sl], biases[sl], err = affine_quantize(w, bits, dtype)
        max_error = max(max_error, err)
    return _quantized(weight, scales, biases, bits, dtype, max_error)


def to_float(raw: np.ndarray, qtype: GGMLQuantizationType, dtype: mx.Dtype) -> mx.array:
    """A float MLX array of any tensor: float types as stored, others dequantized."""
    if qtype == Q.BF16:
        return mx.array(raw).view(mx.bfloat16).astype(dtype)
    if qtype in (Q.F32, Q.F16, Q.F64):
        return mx.array(np.asarray(raw)).astype(dtype)
    shape = (*raw.shape[:-1], -1)
    return mx.array(dequantize(raw.reshape(-1, raw.shape[-1]), qtype).reshape(shape)).astype(dtype)


def convert(
    raw: np.ndarray, qtype: GGMLQuantizationType, dtype: mx.Dtype
) -> QuantizedTensor | mx.array:
    """The MLX form of a 2-D weight (rows, row_bytes): quantized when the type is.

    Exact types keep their codes; types without an exact form are requantized when a
    row holds whole 32-groups and are otherwise dequantized to ``dtype``.
    """
    if qtype in FLOAT_TYPES:
        return to_float(raw, qtype, dtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw2 = raw.reshape(-1, raw.shape[-1])
    cols = raw2.shape[1] // size * block
    if qtype in _EXACT:
        return convert_exact(raw2, qtype, cols, dtype)
    if qtype in REQUANT_BITS and cols % GROUP == 0:
        return requantize(raw2, qtype, cols, dtype, REQUANT_BITS[qtype])
    return to_float(raw, qtype, dtype)


# ---- tests -------------------------------------------------------------------------


def _same(a: mx.array, b: mx.array) -> bool:
    """Equal bytes, but for the sign of a zero: the current converter turns a group of
    zeros' -0.0 bias into +0.0 (the reference keeps whichever zero numpy's min gives)."""
    if mx.issubdtype(a.dtype, mx.floating):
        a, b = a + 0.0, b + 0.0
    if a.dtype == mx.bfloat16:
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    x, y = np.array(a), np.array(b)
    return a.dtype == b.dtype and a.shape == b.shape and x.tobytes() == y.tobytes()


def assert_identical(new: QuantizedTensor | mx.array, old: QuantizedTensor | mx.array) -> None:
    if isinstance(old, mx.array):
        assert isinstance(new, mx.array) and _same(new, old)
        return
    assert isinstance(new, QuantizedTensor)
    assert (new.bits, new.group_size, new.max_error) == (old.bits, old.group_size, old.max_error)
    for name in ("weight", "scales", "biases"):
        assert _same(getattr(new, name), getattr(old, name)), name


RANDOM_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", RANDOM_TYPES, ids=lambda t: t.name)
def test_matches_previous_implementation(
    qtype: GGMLQuantizationType, dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = random_blocks(qtype, 96, 512, seed=int(qtype))
    monkeypatch.setattr(gguf_quant, "_CHUNK_ELEMENTS", 512 * 7)  # many uneven chunks
    monkeypatch.setattr(gguf_quant, "_EXACT_CHUNK_ELEMENTS", 512 * 7)  # and for the exact types
    assert_identical(gguf_quant.convert(raw, qtype, dtype), convert(raw, qtype, dtype))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_matches_previous_on_quantized_weights(qtype: GGMLQuantizationType) -> None:
    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    raw = gguf_quants.quantize(w, qtype)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        assert_identical(gguf_quant.convert(raw, qtype, dtype), convert(raw, qtype, dtype))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_matches_previous(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(37, 256), dtype=np.uint8)
    assert np.array_equal(gguf_quant.pack_codes(codes, bits), pack_codes(codes, bits))


def test_bf16_rounding_matches_mlx() -> None:
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, size=1 << 16, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    edge = np.array([0.0, -0.0, 1.0, 3.4e38, -3.4e38, 1e-40, np.inf, -np.inf], np.float32)
    x = np.concatenate([x, edge])
    want = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert gguf_quant._bf16_round(x).tobytes() == want.tobytes()


def test_affine_quantize_matches_previous() -> None:
    w = np.random.default_rng(7).standard_normal((33, 256)).astype(np.float32)
    w[0, :32] = 0.5  # a constant group
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        new, old = gguf_quant.affine_quantize(w, 6, dtype), affine_quantize(w, 6, dtype)
        for a, b in zip(new[:3], old[:3], strict=True):
            assert a.tobytes() == b.tobytes()
        assert new[3] == old[3]
