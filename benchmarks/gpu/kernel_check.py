"""The 4-bit decode kernel against MLX's own quantized matmul, on the GPU machine:
correctness (against MLX's quantized matmul on the CPU backend, same inputs) and speed
(against MLX's CUDA quantized matmul) for Llama-3-8B's layer shapes at 1-32 rows.

    python benchmarks/gpu/kernel_check.py
"""

from __future__ import annotations

import time

import mlx.core as mx

from gmlx.engine.kernels import qmv_cuda
from gmlx.engine.kernels.fast_linear import agrees, exact_product

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]


def timed(fn, reps: int = 50) -> float:
    """Microseconds per product, ``reps`` of them queued before one wait (so launch and
    synchronization costs do not dominate, as in a decode step of many layers)."""
    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    assert qmv_cuda.available(), "MLX does not run on CUDA here"
    mx.random.seed(0)
    print(f"{'K x N':>13} {'rows':>4} {'ok':>3} {'mlx us':>8} {'kernel us':>9} {'speed-up':>8} {'GB/s':>6}")
    for k, n in SHAPES:
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(wq, s, b)
        for rows in (1, 2, 4, 8, 16, 32):
            x = mx.random.normal((rows, k)).astype(mx.float16)
            got = qmv_cuda.qmv4(x, wq, s, b, 64)
            want_cpu = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4,
                                           stream=mx.cpu)
            with mx.stream(mx.cpu):
                exact = exact_product(x, wq, s, b, 64)
            ok = agrees(got, want_cpu, exact)
            args = (x, wq, s, b)
            t_mlx = timed(lambda a=args: mx.quantized_matmul(*a, transpose=True, group_size=64, bits=4))
            t_k = timed(lambda a=args: qmv_cuda.qmv4(*a, 64))
            gbs = (wq.nbytes + s.nbytes + b.nbytes) / (t_k * 1e-6) / 1e9
            print(f"{k:>6}x{n:<6} {rows:>4} {'yes' if ok else 'NO':>3} {t_mlx:>8.1f} {t_k:>9.1f} "
                  f"{t_mlx / t_k:>7.2f}x {gbs:>6.0f}")


if __name__ == "__main__":
    main()
