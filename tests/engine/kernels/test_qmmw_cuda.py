"""The wide-load tensor-core kernel's arithmetic, replayed here in numpy lane by lane
(CUDA cannot run on this machine; on the GPU machine the load-time tuner checks the
kernel itself against MLX's product at every load, and refuses it where it disagrees).

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

from gmlx.engine.kernels import qmmw_cuda
from tests.engine.kernels import byte_perm


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
    body = qmmw_cuda._BODY
    assert body.startswith("#define FMA2")
    assert "//" not in body.split("#define MMA")[1].split("\n", 4)[-1]
    assert body.count("fma.rn.bf16x2") == 1 and body.count("fma.rn.f16x2") == 1
