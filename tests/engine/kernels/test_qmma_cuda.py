"""The tensor-core kernel's arithmetic, replayed here in numpy lane by lane (CUDA cannot
run on this machine; the kernel itself is checked against MLX's CPU product on the GPU
machine by ``benchmarks/gpu/kernel_check.py`` and at every load there).

What is replayed: each lane's bit window of a chunk and the code pairs it makes, the
half-float bit trick that turns a pair of codes into ``OFF + q``, the ``__byte_perm``
pairing of ``x``, the A/B/C register layouts of ``mma.sync.m16n8k16`` (PTX ISA) and the
scale-and-bias epilogue. Together they must give ``x @ dequantize(w).T``."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import qmma_cuda
from tests.engine.kernels import byte_perm


def _halves(word: int, bf16: bool) -> tuple[float, float]:
    lo, hi = word & 0xFFFF, word >> 16
    if bf16:
        return tuple(float(np.array([v << 16], np.uint32).view(np.float32)[0]) for v in (lo, hi))
    return tuple(float(np.array([v], np.uint16).view(np.float16)[0]) for v in (lo, hi))


@pytest.mark.parametrize(("bf16", "bits"), [(True, 4), (True, 6), (False, 4), (False, 8)])
def test_a_pair_of_codes_becomes_two_half_floats_offset_by_off(bf16: bool, bits: int) -> None:
    magic, off = (0x43004300, 128.0) if bf16 else (0x64006400, 1024.0)
    for lo, hi in itertools.product(range(2**bits), (0, 1, 2**bits - 1)):
        assert _halves(magic | lo | (hi << 16), bf16) == (off + lo, off + hi)


def _replay(x: np.ndarray, wq: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int,
            group: int, bf16: bool) -> np.ndarray:
    """The kernel's product, computed the way its lanes and tensor-core calls do."""
    rows, k = x.shape
    n = wq.shape[0]
    mask = (1 << bits) - 1
    off = 0.0 if (bf16 and bits == 8) else (128.0 if bf16 else 1024.0)
    xbits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint64) if bf16 else \
        x.astype(np.float16).view(np.uint16).astype(np.uint64)
    xval = x.astype(np.float64)
    out = np.zeros((rows, n))
    for f0, r0, c in itertools.product(range(0, n, 16), range(0, rows, 8), range(k // 32)):
        a = np.full((2, 16, 16), np.nan)   # [mma][feature][logical k]
        bmat = np.full((2, 16, 8), np.nan)  # [mma][logical k][row]
        scale, offset, xsum = np.zeros(16), np.zeros(16), np.zeros(8)
        for g, t in itertools.product(range(8), range(4)):
            first_bit = 8 * t * bits
            for h in range(2):
                f = min(f0 + g + 8 * h, n - 1)
                p = c * bits + first_bit // 32
                v = int(wq[f, p]) | ((int(wq[f, p + 1]) << 32) if bits > 4 else 0)
                v >>= first_bit % 32
                pairs = [((v >> (bits * j)) & mask, (v >> (bits * (j + 4))) & mask) for j in range(4)]
                for m in range(2):  # a[m][h] = pair 2m, a[m][2 + h] = pair 2m + 1
                    for reg, pair in ((h, pairs[2 * m]), (2 + h, pairs[2 * m + 1])):
                        row = g + 8 * (reg % 2)
                        col = 2 * t + 8 * (reg // 2)
                        assert np.isnan(a[m, row, col:col + 2]).all()
                        a[m, row, col:col + 2] = (off + pair[0], off + pair[1])
                grp = c * 32 // group
                scale[g + 8 * h] = s[f, grp]
                # folded in float32, as the kernel does
                offset[g + 8 * h] = np.float32(b[f, grp]) - np.float32(off) * np.float32(s[f, grp])
            r = r0 + g
            if r < rows:
                words = [int(sum(int(xbits[r, c * 32 + 8 * t + 2 * i + j]) << (16 * j) for j in range(2)))
                         for i in range(4)]
                xsum[g] = xval[r, c * 32 + 8 * t:c * 32 + 8 * t + 8].sum() + (xsum[g] if t else 0)
            else:
                words = [0, 0, 0, 0]
            regs = [byte_perm(words[0], words[2], 0x5410), byte_perm(words[0], words[2], 0x7632),
                    byte_perm(words[1], words[3], 0x5410), byte_perm(words[1], words[3], 0x7632)]
            for m in range(2):  # b0: logical k 2t, 2t+1; b1: 2t+8, 2t+9; column g
                for i, reg in enumerate(regs[2 * m:2 * m + 2]):
                    kk = 2 * t + 8 * i
                    assert np.isnan(bmat[m, kk:kk + 2, g]).all()
                    bmat[m, kk:kk + 2, g] = _halves(reg, bf16)
        assert not np.isnan(a).any() and not np.isnan(bmat).any()
        cmat = a[0] @ bmat[0] + a[1] @ bmat[1]  # what the two mma.sync calls accumulate
        part = scale[:, None] * cmat + offset[:, None] * xsum[None, :]
        for g, rr in itertools.product(range(16), range(8)):
            if f0 + g < n and r0 + rr < rows:
                out[r0 + rr, f0 + g] += part[g, rr]
    return out


@pytest.mark.parametrize(("bits", "group", "rows", "dtype"), [
    (4, 32, 1, mx.bfloat16), (4, 64, 3, mx.bfloat16), (6, 32, 9, mx.bfloat16),
    (8, 32, 2, mx.bfloat16), (8, 128, 5, mx.float16), (4, 32, 2, mx.float16),
])
def test_the_lanes_compute_the_product(bits: int, group: int, rows: int, dtype: mx.Dtype) -> None:
    mx.random.seed(bits * group + rows)
    n, k = 24, 128  # a partial feature tile, and four chunks
    wq, s, b = mx.quantize(mx.random.normal((n, k)), group_size=group, bits=bits)
    x = mx.random.normal((rows, k)).astype(dtype)
    want = np.array(mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32))
    xf = np.array(x.astype(mx.float32))
    got = _replay(xf, np.array(wq), np.array(s), np.array(b), bits, group, dtype == mx.bfloat16)
    # exact but for OFF * s folded into the bias in float32 (an error of about
    # 2**-24 * OFF * s * sum(x) per chunk: 1e-4 here at fp16's OFF of 1024)
    np.testing.assert_allclose(got, xf.astype(np.float64) @ want.T.astype(np.float64),
                               rtol=1e-5, atol=5e-4)


def test_which_products_may_take_the_kernel() -> None:
    assert qmma_cuda.supports(1, 4096, 32, 4) and qmma_cuda.supports(64, 14336, 32, 6)
    assert qmma_cuda.supports(8, 4096, 128, 8)
    assert not qmma_cuda.supports(65, 4096, 32, 4)  # a prefill chunk: not decode-sized
    assert not qmma_cuda.supports(1, 4096, 32, 5)
    assert not qmma_cuda.supports(1, 4000 + 16, 32, 4)
    assert not qmma_cuda.supports(1, 4096, 32, 4, mode="mxfp4")


def test_launch_shapes_fit_shared_memory() -> None:
    for rows in (1, 8, 9, 16, 32, 64):
        tiles = qmma_cuda.row_tiles(rows)
        assert tiles * 8 >= rows and tiles in (1, 2, 4, 8)
        for ft, warps, _ in qmma_cuda.configs(rows):
            assert (warps - 1) * ft * tiles * 128 * 4 <= 48 * 1024


def test_a_bound_launch_makes_each_kernel_once_and_keeps_leading_dimensions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's launch is worked out once per row-tile count, the constants in a kernel's
    source (MLX builds the source at every call), and a decode step's ``(streams, 1, K)``
    input is read as ``streams`` rows without a reshape. (``cuda_kernel`` stands in here,
    answering with MLX's own product: MLX has no CUDA backend on this machine.)"""
    made: list[dict] = []
    launched: list[dict] = []

    def cuda_kernel(**made_with):
        made.append(made_with)

        def kernel(inputs, grid, threadgroup, output_shapes, output_dtypes, **rest):
            assert not rest  # no template arguments to format per call
            launched.append({"grid": grid, "threadgroup": threadgroup, "shape": output_shapes[0]})
            x, w, s, b = inputs
            y = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
            return [y.reshape(output_shapes[0]).astype(output_dtypes[0])]

        return kernel

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    qmma_cuda._kernel.cache_clear()
    wq, s, b = mx.quantize(mx.random.normal((40, 128)), group_size=32, bits=4)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    try:
        run = qmma_cuda.bound(wq, s, b, 32, 4, config=(1, 4, 4))
        for streams in (3, 5, 12):
            x = mx.random.normal((streams, 1, 128)).astype(mx.float16)
            assert run(x).shape == (streams, 1, 40)
    finally:
        qmma_cuda._kernel.cache_clear()
    assert [m["name"].rsplit("_", 1)[0] for m in made] == ["gmlx_qmma_half_half_1_4_32_1_4_4",
                                                          "gmlx_qmma_half_half_2_4_32_1_4_4"]
    assert made[0]["source"].startswith("using T = __half; using S = __half; constexpr int RT = 1; ")
    assert "x_ndim" in made[0]["source"] and "//" not in made[0]["source"]
    assert [launch["grid"] for launch in launched] == [(3 * 32 * 4, 1, 1)] * 3  # 40 features: 3 tiles of 16
    assert [launch["shape"] for launch in launched] == [(3, 1, 40), (5, 1, 40), (12, 1, 40)]
