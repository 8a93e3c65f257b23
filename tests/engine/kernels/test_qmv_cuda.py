"""The 4-bit decode kernel: never used where it is not built. Its check against MLX's
own quantized matmul on the CPU backend (same inputs, 1% of the largest output) runs on
a CUDA machine: ``benchmarks/gpu/kernel_check.py``, and at every load there
(``fast_linear._measure`` uses it only where it agrees and is faster)."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from gmlx.engine.kernels import qmv_cuda
from gmlx.engine.kernels.fast_linear import (
    FastQuantizedLinear,
    agrees,
    exact_product,
    use_fast_kernels,
)


def test_which_products_the_kernel_takes() -> None:
    assert qmv_cuda.supports(1, 4096, 64, 4) and qmv_cuda.supports(32, 14336, 128, 4)
    assert not qmv_cuda.supports(33, 4096, 64, 4)  # a prefill chunk: MLX's matmul
    assert not qmv_cuda.supports(1, 4096, 64, 8)  # 8-bit: MLX's kernel
    assert not qmv_cuda.supports(1, 4000, 64, 4)  # rows not a multiple of 256
    assert not qmv_cuda.supports(1, 4096, 64, 4, mode="mxfp4")


def test_not_used_where_it_is_not_built() -> None:
    model = nn.Sequential(nn.Linear(256, 64))
    nn.quantize(model, group_size=64, bits=4)
    assert not qmv_cuda.available()  # this machine: MLX on the CPU (Metal is the same)
    assert use_fast_kernels(model) is None
    assert not any(isinstance(m, FastQuantizedLinear) for _, m in model.named_modules())


def test_agreement_is_held_to_mlx_own_error() -> None:
    exact = mx.array([[100.0, -50.0, 3.0]])
    mlx_own = exact + mx.array([[0.2, 0.0, 0.0]])  # MLX's product is 0.2 off
    assert agrees(exact + mx.array([[0.0, 0.3, 0.0]]), mlx_own, exact)  # 0.3 <= 2 * 0.2 + 0.1
    assert not agrees(exact + mx.array([[0.0, 0.0, 1.0]]), mlx_own, exact)


def test_the_exact_product_dequantizes() -> None:
    mx.random.seed(0)
    w = mx.random.normal((64, 256))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((2, 256))
    exact = exact_product(x, wq, s, b, 64)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    assert exact.dtype == mx.float32 and mx.allclose(exact, want, atol=1e-3, rtol=1e-3)
