"""4-bit layers that take the decode-sized kernel where it wins (CUDA only).

At load, on CUDA, every distinct (in, out) shape of a model's 4-bit affine layers is
timed both ways (MLX's ``quantized_matmul`` and ``qmv_cuda.qmv4``) at each row bucket
a decode step can have (1, 2, 4, 8, 16, 32 rows); the kernel is used for the buckets
where it was faster, and the layer swaps to :class:`FastQuantizedLinear`. Timing both
also compiles both, before the model reports ready. ``GMLX_QMV_KERNEL=0`` turns it off
(to measure MLX's own path).
"""

from __future__ import annotations

import os
import time
from typing import Any

from mlx import nn

from gmlx.engine.kernels import qmv_cuda

BUCKETS = (1, 2, 4, 8, 16, 32)


class FastQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose products of ``rows`` in ``fast_rows`` take the kernel."""

    fast_rows: frozenset[int] = frozenset()

    def __call__(self, x: Any) -> Any:
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
        if rows <= qmv_cuda.MAX_ROWS and qmv_cuda.row_bucket(rows) in self.fast_rows:
            y = qmv_cuda.qmv4(x, self["weight"], self["scales"], self["biases"], self.group_size)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


def use_fast_kernels(model: nn.Module) -> str | None:
    """Swap the model's 4-bit layers to :class:`FastQuantizedLinear` where the kernel
    measured faster; returns the load note, or None when there is nothing to decide."""
    if os.environ.get("GMLX_QMV_KERNEL", "1") == "0" or not qmv_cuda.available():
        return None
    layers = [(p, m) for p, m in model.named_modules()
              if type(m) is nn.QuantizedLinear and qmv_cuda.supports(
                  1, m.weight.shape[1] * 8, m.group_size, m.bits, getattr(m, "mode", "affine"))]
    if not layers:
        return None
    wins: dict[tuple[int, int, int], frozenset[int]] = {}
    for _, m in layers:
        key = (m.weight.shape[1] * 8, m.weight.shape[0], m.group_size)
        if key not in wins:
            wins[key] = _measure(m)
    swapped = 0
    for _, m in layers:
        fast = wins[(m.weight.shape[1] * 8, m.weight.shape[0], m.group_size)]
        if fast:
            m.__class__ = FastQuantizedLinear
            m.fast_rows = fast
            swapped += 1
    summary = "; ".join(f"{k}x{n}: rows {sorted(f) or 'none'}" for (k, n, _), f in wins.items())
    return f"cuda: 4-bit decode kernel on {swapped} of {len(layers)} layers ({summary})"


def _measure(layer: Any, reps: int = 20) -> frozenset[int]:
    """The row buckets where the kernel beat MLX's quantized matmul on this layer."""
    import mlx.core as mx

    k = layer.weight.shape[1] * 8
    dtype = layer.scales.dtype
    fast = set()
    for rows in BUCKETS:
        x = mx.random.normal((rows, k)).astype(dtype)

        def mlx_path(x: Any = x) -> Any:
            return mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, transpose=True,
                                       group_size=layer.group_size, bits=layer.bits)

        def kernel(x: Any = x) -> Any:
            return qmv_cuda.qmv4(x, layer.weight, layer.scales, layer.biases, layer.group_size)

        exact = exact_product(x, layer.weight, layer.scales, layer.biases, layer.group_size)
        if not agrees(kernel(), mlx_path(), exact):
            continue  # never use a kernel that disagrees
        if _time(kernel, reps) < _time(mlx_path, reps):
            fast.add(rows)
    return frozenset(fast)


def agrees(got: Any, want: Any, exact: Any) -> bool:
    """Whether the kernel's ``got`` is as close to the float32 product ``exact`` as MLX's
    own quantized matmul ``want`` is (within twice its error, plus 0.1% of the largest
    value): both accumulate in their own order and round to float16."""
    import mlx.core as mx

    got, want, exact = (a.astype(mx.float32) for a in (got, want, exact))
    err_kernel = mx.abs(got - exact).max()
    err_mlx = mx.abs(want - exact).max()
    return (err_kernel <= 2 * err_mlx + 1e-3 * mx.abs(exact).max()).item()


def exact_product(x: Any, layer_or_w: Any, scales: Any, biases: Any, group_size: int) -> Any:
    """``x @ dequantize(w).T`` in float32: the reference both products are held to."""
    import mlx.core as mx

    w = mx.dequantize(layer_or_w, scales, biases, group_size=group_size, bits=4)
    return x.astype(mx.float32) @ w.astype(mx.float32).T


def _time(fn: Any, reps: int) -> float:
    """Seconds for ``reps`` products queued before one wait, as a decode step queues its
    layers (a wait per product would time the synchronization instead)."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    return time.perf_counter() - start
