"""The decode-sized quantized paths against MLX's own quantized matmul, on the GPU machine.

For Llama-3-8B's layer shapes, at 1-64 rows and a prefill chunk's 512, in the layouts a
Q4_K_M GGUF loads as (4-bit and 6-bit, group 32) and mlx-lm's 4-bit (group 64):
correctness of the tensor-core kernel (``qmmw_cuda``; ``timing.agrees``: within
twice MLX's own error against a float32 product, MLX's product taken on the CPU backend
from the same inputs) and microseconds per product (50 queued per wait, x as (rows, K))
for MLX's quantized matmul, the dequantize+dense path, the kernel at the best of its
launch shapes, and a dense matmul of the same weights (the float reference). First a
per-call floor (a 256x256 product, and the cost of building vs evaluating 200 of them),
last a decode step of the 8B built from those figures (Q4_K_M's mix of 4- and 6-bit
layers), per path and width.

    python benchmarks/gpu/kernel_check.py [--out FILE.md] [--quick] [--explore]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import mlx.core as mx

from gmlx.engine.kernels import cuda_source, qmmw_cuda
from gmlx.engine.kernels.fast_linear import dequantized
from gmlx.engine.kernels.timing import agrees, exact_product

# (in, out) of Llama-3-8B's products: q/o, k/v, gate/up, down, lm_head
SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
LAYOUTS = [(4, 32), (6, 32), (4, 64)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 512)
# (feature tiles, warps, chunks in flight) tried by --explore
EXPLORE = [(1, 4, 1), (1, 4, 4), (1, 8, 2), (1, 8, 8), (1, 2, 8), (2, 4, 4), (2, 8, 2), (1, 16, 2)]
# A Q4_K_M Llama-3-8B decode step: (in, out, bits, count); llama.cpp gives attn_v and
# ffn_down 6 bits in about half the layers, and the output layer 6 bits.
STEP = [(4096, 4096, 4, 64), (4096, 1024, 4, 48), (4096, 1024, 6, 16), (4096, 14336, 4, 64),
        (14336, 4096, 4, 16), (14336, 4096, 6, 16), (4096, 128256, 6, 1)]


def timed(fn, reps: int = 50) -> float:
    """Microseconds per product, ``reps`` of them queued before one wait."""
    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    mx.eval([fn() for _ in range(reps)])
    return (time.perf_counter() - start) / reps * 1e6


def check(fn, x, q, g, bits) -> tuple[str, float]:
    """("yes"/"NO"/"error", microseconds) of one path against MLX's CPU product."""
    with mx.stream(mx.cpu):
        want = mx.quantized_matmul(x, *q, transpose=True, group_size=g, bits=bits)
        exact = exact_product(x, *q, g, bits)
        mx.eval(want, exact)
    try:
        good = agrees(fn(), want, exact)
    except RuntimeError as e:
        print(f"  error: {str(e)[:2000]}", flush=True)
        return "error", float("nan")
    return ("yes", timed(fn)) if good else ("NO", float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true", help="default launch shapes only")
    parser.add_argument("--shapes", type=lambda v: [tuple(map(int, s.split("x"))) for s in v.split(",")],
                        default=SHAPES, help="KxN,... (default: the 8B's)")
    parser.add_argument("--layouts", type=lambda v: [tuple(map(int, s.split("/"))) for s in v.split(",")],
                        default=LAYOUTS, help="bits/group,... (default: 4/32,6/32,4/64)")
    parser.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=ROWS)
    parser.add_argument("--explore", action="store_true",
                        help="time every launch shape of EXPLORE on two shapes (4/32)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = parser.parse_args()
    assert cuda_source.available(), "MLX does not run on CUDA here"
    dtype = getattr(mx, args.dtype)
    mx.random.seed(0)
    lines = [f"mlx {mx.__version__}, {mx.default_device()}, activations {args.dtype}", "",
             ("| K x N | bits/g | rows | mlx us | dense us | float us | "
              "tc ok | tc us | tc cfg | best path | speed-up | tc GB/s |"),
             "|---|---|---:|---:|---:|---:|---|---:|---|---|---:|---:|"]
    print("\n".join(lines), flush=True)
    small = mx.random.normal((256, 256)).astype(dtype)
    sq = mx.quantize(small, group_size=32, bits=4)
    xs = mx.random.normal((1, 256)).astype(dtype)
    floor = {"add": timed(lambda: xs + 1), "float": timed(lambda: xs @ small.T),
             "mlx": timed(lambda: mx.quantized_matmul(xs, *sq, transpose=True, group_size=32, bits=4)),
             "tc": timed(lambda: qmmw_cuda.qmm(xs, *sq, 32, 4))}
    built = time.perf_counter()
    outs = [qmmw_cuda.qmm(xs, *sq, 32, 4) for _ in range(200)]
    built, start = time.perf_counter() - built, time.perf_counter()
    mx.eval(outs)
    floor["tc build"], floor["tc eval"] = built / 200 * 1e6, (time.perf_counter() - start) / 200 * 1e6
    built = time.perf_counter()
    outs = [xs @ small.T for _ in range(200)]
    built, start = time.perf_counter() - built, time.perf_counter()
    mx.eval(outs)
    floor["float build"], floor["float eval"] = built / 200 * 1e6, (time.perf_counter() - start) / 200 * 1e6
    lines.insert(1, "per-call floor (256x256, 1 row, us): " + ", ".join(f"{k} {v:.1f}" for k, v in floor.items()))
    print(lines[1], flush=True)
    best_times: dict[tuple[int, ...], dict[str, float]] = {}
    for (k, n), (bits, g) in itertools.product(args.shapes, args.layouts):
        if g == 64 and (k, n) == (4096, 128256):
            continue
        w = (mx.random.normal((n, k)) * 0.02).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=g, bits=bits)
        mx.eval(wq, s, b)
        q = (wq, s, b)
        weight_bytes = wq.nbytes + s.nbytes + b.nbytes
        for rows in args.rows:
            x = mx.random.normal((rows, k)).astype(dtype)
            t_mlx = timed(lambda x=x, q=q, g=g, bits=bits: mx.quantized_matmul(x, *q, transpose=True, group_size=g, bits=bits))
            t_dense = timed(lambda x=x, q=q, g=g, bits=bits: dequantized(x, *q, g, bits))
            wd = mx.dequantize(*q, group_size=g, bits=bits).astype(dtype)
            mx.eval(wd)
            t_float = timed(lambda x=x, wd=wd: x @ wd.T)
            del wd
            paths = {"mlx": t_mlx, "dense": t_dense}
            ok_tc, t_tc, cfg_tc = "—", float("nan"), "—"
            if qmmw_cuda.supports(rows, k, g, bits):
                configs = qmmw_cuda.configs(rows)[:1] if args.quick else qmmw_cuda.configs(rows)
                if args.explore and (bits, g) == (4, 32) and (k, n) in ((4096, 4096), (4096, 14336)):
                    configs = [c for c in EXPLORE if qmmw_cuda.fits(rows, c)]
                for cfg in configs:
                    ok, t = check(lambda x=x, cfg=cfg, q=q, g=g, bits=bits: qmmw_cuda.qmm(x, *q, g, bits, config=cfg),
                                  x, q, g, bits)
                    ok_tc = ok if ok_tc in ("—", "yes") else ok_tc
                    if not math.isnan(t) and not t_tc <= t:
                        t_tc, cfg_tc = t, "x".join(map(str, cfg))
                    if args.explore:
                        print(f"  {k}x{n} {bits}/{g} rows {rows} tc {'x'.join(map(str, cfg))}: {ok} {t:.1f} us",
                              flush=True)
                if not math.isnan(t_tc):
                    paths["tc"] = t_tc
            best = min(paths, key=paths.__getitem__)
            best_times[(k, n, bits, g, rows)] = paths
            gbs = weight_bytes / (t_tc * 1e-6) / 1e9 if not math.isnan(t_tc) else float("nan")
            line = (f"| {k}x{n} | {bits}/{g} | {rows} | {t_mlx:.1f} | {t_dense:.1f} | {t_float:.1f} | "
                    f"{ok_tc} | {t_tc:.1f} | {cfg_tc} | {best} | "
                    f"{t_mlx / paths[best]:.2f}x | {gbs:.0f} |")
            lines.append(line)
            print(line, flush=True)
            if args.out:  # kept as it grows: a call cut off at its limit still brings it back
                with open(args.out, "w") as f:
                    f.write("\n".join(lines) + "\n")
    lines += ["", "Q4_K_M 8B decode step from these products (ms; layers only, no attention):", "",
              "| rows | mlx | tc | best path | tok/s at best |", "|---:|---:|---:|---:|---:|"]
    for rows in args.rows:
        step = {"mlx": 0.0, "tc": 0.0, "best": 0.0}
        for k, n, bits, count in STEP:
            paths = best_times.get((k, n, bits, 32, rows))
            if paths is None:
                continue
            step["mlx"] += count * paths["mlx"] / 1e3
            step["tc"] += count * paths.get("tc", float("nan")) / 1e3
            step["best"] += count * min(paths.values()) / 1e3
        lines.append(f"| {rows} | {step['mlx']:.2f} | {step['tc']:.2f} | {step['best']:.2f} | "
                     f"{rows / step['best'] * 1e3:.0f} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
