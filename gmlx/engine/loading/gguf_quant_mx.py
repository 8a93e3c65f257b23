"""The GGUF conversions of ``gguf_quant`` as MLX operations, for a GPU (Metal or CUDA).

``gguf_quant`` converts on the host with numpy on a thread pool: its many small
operations per row chunk hold the GIL, so on a 16-core host an 8B Q4_K_M model still
took ~55 s (measured on the H200's host, where most of the time was threads waiting for
the GIL). Here each chunk of rows (about :data:`CHUNK_ELEMENTS` elements) goes to the
default device once, and the same unpacking, scale arithmetic, requantization and
packing run there as a few dozen whole-array operations: the GPU does them at memory
speed, the host only copies the GGUF's bytes in.

The results are the numpy path's bit for bit (tested on the CPU backend against it): the
codes are the same integers, and every float step is the same IEEE operation in the same
order (products of float32 values, ``(hi - lo) / levels``, ``(w - bias) / scale`` rounded
half to even, rounding to the storage dtype), each its own MLX operation, so none is
fused into a different one. :func:`wanted` says when the loader uses this path: when
MLX's default device is a GPU; on the CPU backend numpy's threads do as well or better.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from math import gcd

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
GROUP = 32
# Elements per chunk: large enough that each operation is a big kernel, small enough
# that a chunk's float32 temporaries (a few copies of it) stay well under a GB.
CHUNK_ELEMENTS = 1 << 24

Decoded = tuple[mx.array, mx.array, mx.array]  # codes (packed bytes or one per byte), scale, bias


def wanted() -> bool:
    """Whether to convert on MLX's default device: it is a GPU, and ``GMLX_CONVERT_ON``
    is not ``host`` (the numpy path everywhere: a way back should a backend misbehave)."""
    if os.environ.get("GMLX_CONVERT_ON", "").strip().lower() == "host":
        return False
    return mx.default_device().type == mx.DeviceType.gpu


def _f16(b: mx.array, start: int) -> mx.array:
    """The fp16 field at byte ``start`` of every block, as a float32 column (N, 1)."""
    return mx.contiguous(b[:, start : start + 2]).view(mx.float16).astype(mx.float32)


def _nibbles(qs: mx.array) -> mx.array:
    """Bytes (N, k, L) -> low nibbles then high nibbles along the last axis."""
    return mx.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _nibble_pack(qs: mx.array) -> mx.array:
    """Bytes (N, k, L) whose low nibbles are elements 0..L-1 of a run and high nibbles
    elements L..2L-1 -> MLX's 4-bit stream of that run, (N, k, L) bytes."""
    pairs = qs.reshape(*qs.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    return mx.stack([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-2).reshape(qs.shape)


def _low_bits(qh: mx.array, n: int) -> mx.array:
    """Bit i of a little-endian uint32 per block (N, 4 bytes) -> (N, n) of 0/1."""
    words = mx.contiguous(qh).view(mx.uint32)
    return ((words >> mx.arange(n, dtype=mx.uint32)) & 1).astype(mx.uint8)


def _q4_0(b: mx.array) -> Decoded:
    d = _f16(b, 0)
    return _nibble_pack(b[:, 2:18]), d, -8.0 * d


def _q4_1(b: mx.array) -> Decoded:
    return _nibble_pack(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: mx.array) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_low_bits(b[:, 2:6], 32) << 4), d, -16.0 * d


def _q5_1(b: mx.array) -> Decoded:
    return _nibbles(b[:, 8:24]) | (_low_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b: mx.array) -> Decoded:
    d = _f16(b, 0)
    return b[:, 2:34] ^ 0x80, d, -128.0 * d  # int8 + 128 as a byte: the sign bit flipped


def _k_affine(b: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K's eight (scale, bias) pairs per block (see ``gguf_quant.k_scales_mins``)."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    lo, mid, hi = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = mx.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = mx.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return d * sc.astype(mx.float32), (-dmin) * mn.astype(mx.float32)


def _q4_k(b: mx.array) -> Decoded:
    scale, bias = _k_affine(b)
    return _nibble_pack(b[:, 16:144].reshape(-1, 4, 32)).reshape(b.shape[0], 128), scale, bias


def _q5_k(b: mx.array) -> Decoded:
    scale, bias = _k_affine(b)
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = (b[:, 16:48][:, None, :] >> mx.arange(8, dtype=mx.uint8)[None, :, None]) & 1
    return (low | (high << 4)).reshape(b.shape[0], 256), scale, bias


# The GGML types with an exact MLX form, the bits of that form (shared with ``gguf_quant``),
# and the ones whose 4-bit codes decode straight into MLX's packed stream.
EXACT_BITS: dict[GGMLQuantizationType, int] = {
    Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5,
}
_DECODERS: dict[GGMLQuantizationType, Callable[[mx.array], Decoded]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
}
PACKED = (Q.Q4_0, Q.Q4_1, Q.Q4_K)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Unsigned codes (rows, n) -> MLX's uint32 words (rows, n * bits / 32), as
    ``gguf_quant.pack_codes``: the stream is cut into runs of ``per`` codes that fill
    whole bytes, and each byte is OR-ed from the codes whose bits fall in it, shifted in
    uint8 (what leaves the byte drops), so no wider integers are needed on any backend."""
    rows, n = codes.shape
    codes = codes.astype(mx.uint8)
    if bits == 8:
        return mx.contiguous(codes).view(mx.uint32)
    per = 8 // gcd(bits, 8)
    runs = codes.reshape(rows, n // per, per)
    out: list[mx.array | None] = [None] * (per * bits // 8)
    for j in range(per):
        first, last = j * bits, (j + 1) * bits - 1  # the bits code j occupies in its run
        for k in range(first // 8, last // 8 + 1):
            shift = first - 8 * k
            part = runs[..., j] << shift if shift >= 0 else runs[..., j] >> -shift
            out[k] = part if out[k] is None else out[k] | part
    return mx.stack(out, axis=-1).reshape(rows, -1).view(mx.uint32)


def q6_k_values(b: mx.array) -> mx.array:
    """Float32 values of Q6_K blocks (N, 210) -> (N, 256), as ``gguf_quant.q6_k_values``:
    ``(d * sc) * (q - 32)`` in float32."""
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    low = mx.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 256)
    high = mx.stack([(qh >> (2 * k)) & 0x03 for k in range(4)], axis=2).reshape(n, 256)
    signed = mx.contiguous(low | (high << 4)).view(mx.int8) - 32
    d = _f16(b, 208)
    step = (d * mx.contiguous(b[:, 192:208]).view(mx.int8).astype(mx.float32)).reshape(n, 16, 1)
    return (signed.reshape(n, 16, 16).astype(mx.float32) * step).reshape(n, 256)


def _round_to(dtype: mx.Dtype) -> Callable[[mx.array], mx.array]:
    if dtype == mx.float32:
        return lambda a: a
    return lambda a: a.astype(dtype).astype(mx.float32)


def affine(w: mx.array, bits: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``gguf_quant.affine_quantize`` of float32 rows (rows, cols): packed codes, scales
    and biases (float32, as stored in ``dtype``) and the max error (a scalar array)."""
    rows, cols = w.shape
    rounder = _round_to(dtype)
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    levels = 2**bits - 1
    scale = mx.where(hi > lo, (hi - lo) / levels, 1.0)
    scale, bias = rounder(scale), rounder(lo + 0.0)  # -0.0 -> +0.0, as the host path
    s3, b3 = scale[..., None], bias[..., None]
    codes = mx.clip(mx.round((g - b3) / s3), 0, levels)
    error = mx.abs(codes * s3 + b3 - g).max()
    return pack_codes(codes.astype(mx.uint8).reshape(rows, cols), bits), scale, bias, error


def row_chunks(rows: int, cols: int, elements: int) -> list[slice]:
    """Slices of ``rows`` rows of ``cols`` elements, about ``elements`` elements each
    (at least one row); the host path chunks its rows the same way."""
    step = max(1, elements // max(cols, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _upload(raw: np.ndarray, sl: slice) -> mx.array:
    return mx.array(np.ascontiguousarray(raw[sl]))


def convert_exact(
    raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array, int]:
    """GGML blocks (rows, row_bytes) -> MLX codes (uint32), scales and biases (computed
    in float32, stored in ``dtype``), losslessly, one row chunk at a time; and the bits."""
    bits, decode = EXACT_BITS[qtype], _DECODERS[qtype]
    _, size = GGML_QUANT_SIZES[qtype]
    weights, scales, biases = [], [], []
    for sl in row_chunks(raw.shape[0], cols, CHUNK_ELEMENTS):
        n = sl.stop - sl.start
        codes, scale, bias = decode(_upload(raw, sl).reshape(-1, size))
        if qtype in PACKED:
            weight = mx.contiguous(codes).reshape(n, -1).view(mx.uint32)
        else:
            weight = pack_codes(codes.reshape(n, cols), bits)
        # One (scale, bias) per 32-group: a block's own (Q4_0..Q8_0) or its eight (K).
        scale, bias = scale.reshape(n, -1).astype(dtype), bias.reshape(n, -1).astype(dtype)
        mx.eval(weight, scale, bias)
        weights.append(weight), scales.append(scale), biases.append(bias)
    return _joined(weights), _joined(scales), _joined(biases), bits


def requantize(
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    cols: int,
    dtype: mx.Dtype,
    bits: int,
    host_values: Callable[[np.ndarray], np.ndarray],
) -> tuple[mx.array, mx.array, mx.array, float]:
    """Dequantize and requantize at group 32 and ``bits`` (``gguf_quant.requantize``):
    Q6_K's values on the device, other types' by ``host_values`` (the reference code);
    scales and biases in ``dtype``, and the max error."""
    _, size = GGML_QUANT_SIZES[qtype]
    weights, scales, biases, errors = [], [], [], []
    for sl in row_chunks(raw.shape[0], cols, CHUNK_ELEMENTS):
        n = sl.stop - sl.start
        if qtype == Q.Q6_K:
            w = q6_k_values(_upload(raw, sl).reshape(-1, size))
        else:
            w = mx.array(host_values(np.ascontiguousarray(raw[sl])))
        weight, scale, bias, error = affine(w.reshape(n, cols), bits, dtype)
        scale, bias = scale.astype(dtype), bias.astype(dtype)
        mx.eval(weight, scale, bias, error)
        weights.append(weight), scales.append(scale), biases.append(bias), errors.append(error)
    error = max((e.item() for e in errors), default=0.0)
    return _joined(weights), _joined(scales), _joined(biases), error


def _joined(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
