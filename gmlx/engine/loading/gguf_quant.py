"""GGUF tensor data -> MLX arrays, in MLX's own affine quantized layout where possible.

MLX affine quantization stores, per group of ``group_size`` consecutive elements of a
row, unsigned codes ``q`` in ``[0, 2**bits)`` and ``w = scale * q + bias``. The codes are
a little-endian bit stream (element i occupies bits ``[i*bits, (i+1)*bits)``) read as
uint32 words, for every bit width. GGML blocks whose geometry is a multiple of 32
elements with one affine scale per 32 map onto that exactly:

==========  =====  ===========================================
GGML type   bits   per 32-element group
==========  =====  ===========================================
Q4_0        4      scale = d,      bias = -8 d
Q4_1        4      scale = d,      bias = m
Q5_0        5      scale = d,      bias = -16 d
Q5_1        5      scale = d,      bias = m
Q8_0        8      scale = d,      bias = -128 d  (codes + 128)
Q4_K        4      scale = d sc_j, bias = -dmin m_j
Q5_K        5      scale = d sc_j, bias = -dmin m_j
==========  =====  ===========================================

Types with 16-element sub-blocks (Q2_K, Q3_K, Q6_K) and the non-linear IQ/TQ types
have no exact MLX form: they are dequantized with the ``gguf`` package's reference code
and requantized (round to nearest over each group's range) at group 32 (see :data:`REQUANT_BITS`); the
caller reports the measured maximum error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from gmlx.engine.loading import gguf_quant_mx

Q = GGMLQuantizationType
GROUP = 32
# Rows are converted in chunks of about this many elements, so temporaries stay small
# (cache-sized) even for a 150k x 4096 embedding; chunks run on a thread pool (numpy
# releases the GIL in its loops) and write disjoint rows of the preallocated outputs.
_CHUNK_ELEMENTS = 1 << 18
# Exact conversion's chunks are larger: its many small operations per chunk hold the
# GIL, and fewer of them let the threads overlap (2 threads here: 226 -> 398 M elements/s).
_EXACT_CHUNK_ELEMENTS = 1 << 20
_THREADS = max(1, os.cpu_count() or 1)

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# Bits of the MLX form for types that must be requantized (no group-16 in MLX).
REQUANT_BITS: dict[GGMLQuantizationType, int] = {
    Q.Q6_K: 6,
    Q.Q3_K: 4,
    Q.Q2_K: 4,
    Q.IQ4_NL: 4,
    Q.IQ4_XS: 4,
    Q.IQ3_S: 4,
    Q.IQ3_XXS: 4,
    Q.IQ2_S: 4,
    Q.IQ2_XS: 4,
    Q.IQ2_XXS: 4,
    Q.IQ1_S: 4,
    Q.IQ1_M: 4,
    Q.TQ1_0: 4,
    Q.TQ2_0: 4,
    Q.MXFP4: 4,
}


@dataclass
class QuantizedTensor:
    """A weight in MLX affine layout, ready for ``QuantizedLinear``/``QuantizedEmbedding``."""

    weight: mx.array  # uint32, (rows, cols * bits / 32)
    scales: mx.array  # (rows, cols / group_size)
    biases: mx.array
    bits: int
    group_size: int
    max_error: float | None = None  # set when requantized: max |w_gguf - w_mlx|


# -- code extraction: GGML blocks -> (codes, scale, bias) per 32-element group --------


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block, as float32 column (N, 1)."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Split bytes (N, k, 16|32) into low nibbles then high nibbles along the last axis."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _nibble_pack(qs: np.ndarray) -> np.ndarray:
    """Bytes (N, k, L) whose low nibbles are elements 0..L-1 of a run and high nibbles
    elements L..2L-1 -> MLX's 4-bit stream of that run, (N, k, L) bytes (element i at bits
    4i): byte j of the first half is ``lo(qs[2j]) | lo(qs[2j+1]) << 4``, of the second
    ``hi(qs[2j]) | hi(qs[2j+1]) << 4``. The codes are never spread one per byte."""
    pairs = qs.reshape(*qs.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = np.empty((*qs.shape[:-1], 2, qs.shape[-1] // 2), np.uint8)
    np.bitwise_and(even, 0x0F, out=out[..., 0, :])
    out[..., 0, :] |= odd << np.uint8(4)
    np.right_shift(even, np.uint8(4), out=out[..., 1, :])
    out[..., 1, :] |= odd & np.uint8(0xF0)
    return out.reshape(qs.shape)


def _low_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit i of a little-endian uint32 per block (N, 4 bytes) -> (N, n) of 0/1."""
    words = qh.copy().view(np.uint32)
    return ((words >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


# Decoders return (codes, scale, bias) per block; the 4-bit ones (``_PACKED``) return
# their codes already in MLX's packed stream (bytes), the others one code per byte.


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibble_pack(b[:, 2:18]), d, -8.0 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibble_pack(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


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
    return _nibble_pack(b[:, 16:144].reshape(-1, 4, 32)).reshape(len(b), 128), scale, bias


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, bias = _k_affine(b)
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).reshape(len(b), 256), scale, bias


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
}
_EXACT = {q: (gguf_quant_mx.EXACT_BITS[q], decode) for q, decode in _DECODERS.items()}
_PACKED = gguf_quant_mx.PACKED
EXACT_TYPES = tuple(_EXACT)
SUPPORTED_TYPES = (*FLOAT_TYPES, *EXACT_TYPES, *REQUANT_BITS)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes (rows, n) into MLX's uint32 words (rows, n * bits / 32).

    The stream is cut into runs of ``per`` codes that fill whole bytes (2 codes at 4
    bits, 4 at 6, 8 at 3 or 5); each byte of a run is OR-ed together, in uint8, from the
    codes whose bits fall in it (shifted into place; numpy's uint8 shifts drop what
    leaves the byte), so nothing wider than the codes themselves is ever allocated.
    """
    rows, n = codes.shape
    codes = codes.astype(np.uint8, copy=False)
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    per = 8 // np.gcd(bits, 8)
    nbytes = per * bits // 8
    runs = codes.reshape(rows, n // per, per)
    out = np.zeros((rows, n // per, nbytes), np.uint8)
    for j in range(per):
        first, last = j * bits, (j + 1) * bits - 1  # the bits code j occupies in its run
        for k in range(first // 8, last // 8 + 1):
            shift = first - 8 * k
            part = runs[..., j] << np.uint8(shift) if shift >= 0 else runs[..., j] >> np.uint8(-shift)
            out[..., k] |= part
    return out.reshape(rows, -1).view(np.uint32)


def _run_chunks(work: Callable[[slice], object], chunks: Iterable[slice], threads: int) -> list:
    """``work`` over row chunks, on a thread pool when there is more than one of each."""
    chunks = list(chunks)
    if threads <= 1 or len(chunks) <= 1:
        return [work(sl) for sl in chunks]
    with ThreadPoolExecutor(min(threads, len(chunks))) as pool:
        return list(pool.map(work, chunks))


def convert_exact(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, dtype: mx.Dtype
) -> QuantizedTensor:
    """Re-lay GGML blocks (rows, row_bytes) as MLX codes, scales and biases, losslessly.

    The codes are the GGUF's own integers; scales and biases are computed in float32
    and stored in ``dtype`` (float32 keeps them exact; float16 rounds K-quant products).
    """
    if gguf_quant_mx.wanted():
        weight_mx, scales_mx, biases_mx, bits = gguf_quant_mx.convert_exact(raw, qtype, cols, dtype)
        return QuantizedTensor(weight_mx, scales_mx, biases_mx, bits, GROUP)
    bits, decode = _EXACT[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), np.float32)
    biases = np.empty((rows, cols // GROUP), np.float32)
    per_block = block // GROUP

    def work(sl: slice) -> None:
        blocks = np.ascontiguousarray(raw[sl]).reshape(-1, size)
        codes, scale, bias = decode(blocks)
        n = sl.stop - sl.start
        if qtype in _PACKED:
            weight[sl] = codes.reshape(n, -1).view(np.uint32)
        else:
            weight[sl] = pack_codes(codes.reshape(n, cols), bits)
        # Per-block scales repeat over a block's 32-groups (Q4_0..Q8_0 have one group).
        scales[sl] = np.broadcast_to(scale, (len(blocks), per_block)).reshape(n, -1)
        biases[sl] = np.broadcast_to(bias, (len(blocks), per_block)).reshape(n, -1)

    _run_chunks(work, gguf_quant_mx.row_chunks(rows, cols, _EXACT_CHUNK_ELEMENTS), _THREADS)
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


def q6_k_values(raw: np.ndarray) -> np.ndarray:
    """Float32 values of Q6_K blocks (any shape whose bytes are whole blocks) ->
    (blocks, 256): the ``gguf`` reference's arithmetic and element order (``(d * sc) *
    (q - 32)`` in float32, so the same bits), in fewer passes over the data: the codes
    are assembled in place as bytes, and the one float pass is the product.

    A block is 128 bytes of low nibbles (two halves of 64: low nibbles then high
    nibbles of each half are its 128 values' low 4 bits), 64 bytes of high 2-bit pairs
    (two halves of 32, four shifts each), 16 int8 sub-block scales and an fp16 ``d``."""
    b = raw.reshape(-1, 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    codes = np.empty((n, 2, 2, 64), np.uint8)
    np.bitwise_and(ql, 0x0F, out=codes[:, :, 0])
    np.right_shift(ql, 4, out=codes[:, :, 1])
    high = np.empty((n, 2, 4, 32), np.uint8)
    for k in range(4):
        np.right_shift(qh, 2 * k, out=high[:, :, k])
    high &= 0x03
    high <<= 4
    flat = codes.reshape(n, 256)
    flat |= high.reshape(n, 256)
    signed = flat.view(np.int8)
    signed -= 32
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    step = (d * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    return np.multiply(signed.reshape(n, 16, 16), step, dtype=np.float32).reshape(n, 256)


# Types whose reference dequantizer has a faster one here, equal bit for bit.
_FAST_DEQUANTIZE: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {Q.Q6_K: q6_k_values}


def _row_dequantizer(qtype: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    """:func:`dequantize` for contiguous rows, without the ``gguf`` package's 16-row
    batching: the same per-block reference code (or one of ``_FAST_DEQUANTIZE``), so the
    same values."""
    if (fast := _FAST_DEQUANTIZE.get(qtype)) is not None:
        return fast
    quant = getattr(gguf_quants, "_type_traits", {}).get(qtype)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        return lambda raw: dequantize(raw, qtype)
    quant.init_grid()  # before any worker thread needs it
    return lambda raw: quant.dequantize_rows(raw).astype(np.float32, copy=False)


def _bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even (NaN -> canonical NaN)."""
    u = a.astype(np.float32, copy=False).view(np.uint32)
    r = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), r).view(np.float32)


def _rounder(dtype: mx.Dtype, in_threads: bool) -> Callable[[np.ndarray], np.ndarray] | None:
    """float32 -> ``dtype`` -> float32 as MLX stores it: numpy for float32/16 and bfloat16
    (safe on worker threads), else MLX itself (main thread only: ``None`` when
    ``in_threads``)."""
    if dtype == mx.float32:
        return lambda a: a.astype(np.float32, copy=False)
    if dtype == mx.float16:
        return lambda a: a.astype(np.float16).astype(np.float32)
    if dtype == mx.bfloat16:
        return _bf16_round
    if in_threads:
        return None
    return lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))


def _affine(
    w: np.ndarray, bits: int, rounder: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    levels = 2**bits - 1
    scale = np.where(hi > lo, (hi - lo) / levels, 1.0).astype(np.float32)
    # + 0.0 turns a -0.0 minimum (a group of zeros) into +0.0: numpy's and MLX's min
    # reductions return different zeros there, and both paths must give the same bytes
    scale, bias = rounder(scale), rounder(lo + np.float32(0.0))
    s3, b3 = scale[..., None], bias[..., None]
    codes = np.subtract(g, b3)
    np.divide(codes, s3, out=codes)
    np.rint(codes, out=codes)
    np.clip(codes, 0, levels, out=codes)
    back = np.multiply(codes, s3)
    back += b3
    back -= g
    error = float(np.abs(back, out=back).max(initial=0.0))
    packed = pack_codes(codes.astype(np.uint8).reshape(rows, cols), bits)
    return packed, scale, bias, error


def affine_quantize(
    w: np.ndarray, bits: int, dtype: mx.Dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Round-to-nearest affine quantization of float32 rows (rows, cols) at group 32.

    Each group's grid spans exactly its [min, max] (``mx.quantize`` instead keeps zero on
    the grid, which can cost more than half a step at the ends). Codes are computed from
    the scale and bias as stored in ``dtype``, so the error is at most half a step plus
    that rounding. Returns packed codes, scales, biases (float32) and the max error.
    """
    rounder = _rounder(dtype, in_threads=False)
    assert rounder is not None
    return _affine(w, bits, rounder)


def requantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, dtype: mx.Dtype, bits: int
) -> QuantizedTensor:
    """Dequantize (reference code) and requantize at group 32 and ``bits``.

    ``max_error`` is the largest absolute difference between the GGUF's values and the
    MLX ones (before any rounding of the dequantized output to ``dtype``).
    """
    dequantize_rows = _row_dequantizer(qtype)
    if gguf_quant_mx.wanted():
        *arrays, error = gguf_quant_mx.requantize(raw, qtype, cols, dtype, bits, dequantize_rows)
        return QuantizedTensor(*arrays, bits, GROUP, max_error=error)
    rows = raw.shape[0]
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), np.float32)
    biases = np.empty((rows, cols // GROUP), np.float32)
    rounder = _rounder(dtype, in_threads=True)
    threads = _THREADS if rounder is not None else 1
    rounder = rounder or _rounder(dtype, in_threads=False)
    assert rounder is not None

    def work(sl: slice) -> float:
        w = dequantize_rows(np.ascontiguousarray(raw[sl])).reshape(-1, cols)
        weight[sl], scales[sl], biases[sl], err = _affine(w, bits, rounder)
        return err

    errors = _run_chunks(work, gguf_quant_mx.row_chunks(rows, cols, _CHUNK_ELEMENTS), threads)
    return _quantized(weight, scales, biases, bits, dtype, max(errors, default=0.0))


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
