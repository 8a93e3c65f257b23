"""The CUDA-core kernel (``gmlx.engine.kernels.qgemv_cuda``; one row, or a few with
``--rows``) on the GPU machine: its output
against MLX's product on the CPU backend (the same inputs; agreement as the tuner holds
it: within twice MLX's own error against a float32 product, plus 0.1% of the largest
value, or ``qgemv_q8.tolerance``'s share where a one-row product rounds x), and microseconds per product against MLX's CUDA product at each launch shape,
on a Llama-3-8B's layer shapes in a Q4_K_M GGUF's layouts (stacked q/k/v and gate/up
included), with the bandwidth it reached.

    python benchmarks/gpu/gemv_check.py [--dtype float16] [--reps 50] [--rows 1,2,4,8]
    python benchmarks/gpu/gemv_check.py --gated --rows 1,2,8 --dtype bfloat16
    python benchmarks/gpu/gemv_check.py --normed --reps 30

``--gated``: the gated product (``glu_cuda``: an MLP's gate and up projections and
swiglu in one kernel) on the 8B's MLP (4096 to 14336, 4-bit), against MLX's two products
and mlx-lm's swiglu on the CPU backend (agreement as above, against float32 products
through a float32 swiglu) and timed against the three of them on the GPU. ``--qkv``: the
parts product (``qkv_cuda``: an attention's queries, keys and values in one launch, each
to its own output) on the 8B's attention (4096 to 4096 + 1024 + 1024, 4-bit), against
MLX's three products. ``--normed``: both with the RMSNorm before them folded in, x made
by each warp, prepared once a block (``qgemv_prepared``) or rounded to bytes once a block
(``qgemv_q8``), against MLX's norm and products. The plain products' 4-bit one-row
kernels round x to bytes by default, as a load's do (held to ``qgemv_q8.TOLERANCE``);
``GMLX_Q8X=0`` in the environment times their float sums.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gmlx.engine.kernels import qgemv_cuda, qgemv_q8, timing
from gmlx.engine.kernels.timing import agrees, chain_call_time, chain_time, device_chain_time, fed

# (K, N, bits): an 8B's products in Q4_K_M's layouts
SHAPES = [(4096, 4096, 4), (4096, 1024, 4), (4096, 6144, 4), (4096, 5120, 4), (4096, 1024, 6),
          (4096, 14336, 4), (4096, 28672, 4), (14336, 4096, 4), (14336, 4096, 6), (4096, 128256, 6),
          (4096, 4096, 8)]


def per_product(fn, x, reps: int) -> float:
    """us a product of ``fn`` (``x`` in, an output or a list of them out), ``reps`` in a
    chain, each one's input the last one's first output (``timing.fed``): products that
    do not depend on each other run at once on a GPU, which a step's do not. By the
    chain's clock, a call's slope between chains of ``reps`` and four times as many (as
    the load's tuners time them: ``timing.per_call``); by the device's, the best of three."""

    def call(y):
        out = fn(y)
        return fed(out[0] if isinstance(out, (list, tuple)) else out, y)

    if CLOCK[0] is chain_time:
        return chain_call_time(call, x, reps) * 1e6
    return min(CLOCK[0](call, x, reps) for _ in range(3)) / reps * 1e6


def calls_a_product(reps: int) -> int:
    """The calls :func:`per_product` makes for ``reps`` (each run's three warm-up calls
    among them): what a window of ncu's launches holds."""
    if CLOCK[0] is chain_time:
        return timing.ROUNDS * (2 * 3 + reps + timing.LONGER * reps)
    return 3 * (3 + reps)


# the clock ``per_product`` reads: the chain's (the host's where it is slower than the
# device) or, with ``--device``, the device's part alone (``timing.device_chain_time``)
CLOCK = [chain_time]


def _shape(c: tuple[int, ...]) -> str:
    """A launch shape as the tables name it: warps x rows a warp, its depth, its row tiles
    with x staged, the warps splitting K, the rounds streamed."""
    warps, rpw, _, depth, tiles, split, rounds = qgemv_cuda.launch_shape(c)
    return (f"{warps}x{rpw}" + (f" d{depth}" if depth > 1 else "") + (f" x{tiles}" if tiles else "")
            + (f" s{split}" if split > 1 else "") + (f" a{rounds}" if rounds > 1 else ""))


def row(k: int, n: int, bits: int, dtype, g: int, reps: int, rows: int = 1) -> str:
    """One shape's table row: agreement at every launch shape, MLX's time and the kernel's."""
    mx.random.seed(k + n + bits)
    wq, s, b = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=g, bits=bits)
    x = (mx.random.normal((rows, k)) * 2).astype(dtype)
    mx.eval(wq, s, b, x)
    with mx.stream(mx.cpu):
        want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=g, bits=bits)
        w32 = mx.dequantize(wq, s, b, group_size=g, bits=bits).astype(mx.float32)
        exact = x.astype(mx.float32) @ w32.T
        mx.eval(want, exact)
    configs = qgemv_cuda.configs(rows, k)  # with the split shapes where GMLX_SPLIT_K=1
    ok = all(agrees(qgemv_cuda.gemv(x, wq, s, b, g, bits, config=c), want, exact, qgemv_q8.tolerance(bits, rows))
             for c in configs)
    mlx_us = per_product(lambda y: mx.quantized_matmul(y, wq, s, b, transpose=True, group_size=g, bits=bits), x, reps)
    times = {c: per_product(lambda y, c=c: qgemv_cuda.gemv(y, wq, s, b, g, bits, config=c), x, reps)
             for c in configs}
    best = min(times, key=times.get)
    nbytes = wq.nbytes + s.nbytes + b.nbytes
    shapes = ", ".join(f"{_shape(c)}: {t:.1f}" for c, t in times.items())
    return (f"| {k}x{n} | {bits} | {rows} | {'yes' if ok else 'NO'} | {mlx_us:.1f} | {times[best]:.1f} | "
            f"{mlx_us / times[best]:.2f} | {nbytes / times[best] / 1e3:.0f} | {shapes} |")


def gated_row(k: int, n: int, bits: int, dtype, g: int, reps: int, rows: int) -> str:
    """The gated product's row: agreement at its launch shapes, MLX's three kernels' time
    and the one kernel's."""
    from mlx_lm.models.activations import swiglu

    mx.random.seed(k + n + bits + rows)
    gate, up = (mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=g, bits=bits) for _ in range(2))
    x = mx.random.normal((rows, 1, k)).astype(dtype)
    mx.eval(gate, up, x)

    def product(layer, x=x):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=g, bits=bits)

    with mx.stream(mx.cpu):
        want = swiglu(product(gate), product(up))
        exact_g, exact_u = (x.astype(mx.float32) @ mx.dequantize(*layer, group_size=g, bits=bits)
                            .astype(mx.float32).T for layer in (gate, up))
        exact = exact_g * mx.sigmoid(exact_g) * exact_u
        mx.eval(want, exact)
    bucket = 1 if rows == 1 else 1 << (rows - 1).bit_length()
    runs = {c: qgemv_cuda.bound(*gate, g, bits, c, up=up) for c in qgemv_cuda.gated_configs(bucket, k)}
    ok = all(agrees(run(x), want, exact, qgemv_q8.tolerance(bits, rows)) for run in runs.values())
    flat = x.reshape(rows, k)
    mlx_us = per_product(lambda y: swiglu(product(gate, y), product(up, y)), flat, reps)
    times = {c: per_product(run, x, reps) for c, run in runs.items()}
    best = min(times, key=times.get)
    nbytes = sum(a.nbytes for a in (*gate, *up))
    shapes = ", ".join(f"{_shape(c)}: {t:.1f}" for c, t in times.items())
    return (f"| {k}x{n} gate+up, swiglu | {bits} | {rows} | {'yes' if ok else 'NO'} | {mlx_us:.1f} | "
            f"{times[best]:.1f} | {mlx_us / times[best]:.2f} | {nbytes / times[best] / 1e3:.0f} | {shapes} |")


def parts_row(k: int, sizes: tuple[int, ...], bits: int, dtype, g: int, reps: int, rows: int) -> str:
    """The parts product's row: each output's agreement at every launch shape, MLX's
    separate products' time and the one launch's."""
    mx.random.seed(k + sum(sizes) + rows)
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=g, bits=bits) for n in sizes]
    x = mx.random.normal((rows, 1, k)).astype(dtype)
    mx.eval(layers, x)

    def product(layer, x=x):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=g, bits=bits)

    with mx.stream(mx.cpu):
        wants = [product(layer) for layer in layers]
        exacts = [x.astype(mx.float32) @ mx.dequantize(*layer, group_size=g, bits=bits).astype(mx.float32).T
                  for layer in layers]
        mx.eval(wants, exacts)
    bucket = 1 if rows == 1 else 1 << (rows - 1).bit_length()
    runs = {c: qgemv_cuda.bound(*layers[0], g, bits, c, more=tuple(layers[1:])) for c in qgemv_cuda.configs(bucket, k)}
    ok = all(agrees(got, want, exact, qgemv_q8.tolerance(bits, rows)) for run in runs.values()
             for got, want, exact in zip(run(x), wants, exacts, strict=True))
    flat = x.reshape(rows, k)
    mlx_us = per_product(lambda y: [product(layer, y) for layer in layers], flat, reps)
    times = {c: per_product(run, x, reps) for c, run in runs.items()}
    best = min(times, key=times.get)
    nbytes = sum(a.nbytes for layer in layers for a in layer)
    shapes = ", ".join(f"{_shape(c)}: {t:.1f}" for c, t in times.items())
    return (f"| {k}x{'+'.join(map(str, sizes))} parts | {bits} | {rows} | {'yes' if ok else 'NO'} | {mlx_us:.1f} | "
            f"{times[best]:.1f} | {mlx_us / times[best]:.2f} | {nbytes / times[best] / 1e3:.0f} | {shapes} |")


# the normed products' variants beside the default (x made by each warp): x prepared once a
# block (p), x rounded to bytes once a block (q8), each set for its kernels' builds
VARIANTS = {"": {"GMLX_Q8X": "0"}, "p": {"GMLX_PREPARED": "all", "GMLX_Q8X": "0"}, "q8": {"GMLX_Q8X": "1"}}


def takes(variant: str, depth: int, tiles: int, split: int, rounds: int) -> bool:
    """Whether a launch shape (its depth, tiles, split, rounds) takes the source of
    ``variant`` (:data:`VARIANTS`): one unstaged row, not streamed, K whole and a chunk a
    lane at a time; where x is rounded, also more chunks under ``GMLX_Q8_DEPTH=1`` and K
    split between warps at a chunk a lane (``GMLX_SPLIT_K=1``: ``qgemv_split.split_rounded``)."""
    if (tiles, rounds) != (0, 1):
        return False
    if variant == "q8":  # as qgemv_q8.takes has it
        return depth == 1 or (qgemv_q8.deep() and split == 1)
    return split == 1 and depth == 1


def normed_rows(k: int, n: int, sizes: tuple[int, ...], bits: int, dtype, g: int, reps: int) -> list[str]:
    """The products with the norm before them folded in, at one row: the gated MLP (``n``
    outputs) and the attention's parts (``sizes``), at each unstaged launch shape with x
    made by each warp (the default), prepared once a block (``GMLX_PREPARED=all``) and
    rounded to bytes once a block (``GMLX_Q8X=1``; :data:`VARIANTS`, each set for its
    kernels' builds in this process): agreement with MLX's norm then products (each
    variant's, as the load holds it), MLX's time and the kernel's."""
    import os

    from mlx_lm.models.activations import swiglu

    eps = 1e-5
    mx.random.seed(k + n + bits)
    gate, up = (mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=g, bits=bits) for _ in range(2))
    layers = [mx.quantize(mx.random.normal((m, k)).astype(dtype), group_size=g, bits=bits) for m in sizes]
    h = (mx.random.normal((1, 1, k)) * 7 + 2).astype(dtype)
    nw = (mx.random.uniform(shape=(k,)) + 0.5).astype(dtype)
    mx.eval(gate, up, layers, h, nw)

    def product(layer, x):
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=g, bits=bits)

    def exact(layer, x32):
        return x32 @ mx.dequantize(*layer, group_size=g, bits=bits).astype(mx.float32).T

    with mx.stream(mx.cpu):
        normed = mx.fast.rms_norm(h, nw, eps)
        h32 = h.astype(mx.float32)
        n32 = h32 * mx.rsqrt(mx.mean(h32 * h32, axis=-1, keepdims=True) + eps) * nw.astype(mx.float32)
        want_glu = swiglu(product(gate, normed), product(up, normed))
        eg, eu = exact(gate, n32), exact(up, n32)
        exact_glu = eg * mx.sigmoid(eg) * eu
        want_parts = [product(layer, normed) for layer in layers]
        exact_parts = [exact(layer, n32) for layer in layers]
        mx.eval(want_glu, exact_glu, want_parts, exact_parts)
    out = []
    for kind in ("gated", "parts"):
        configs = [c for c in (qgemv_cuda.gated_configs(1, k) if kind == "gated" else qgemv_cuda.configs(1, k))
                   if not qgemv_cuda.launch_shape(c)[4]]  # the norm is not folded into a staged source
        if kind == "gated":
            mlx_us = per_product(lambda y: swiglu(product(gate, mx.fast.rms_norm(y, nw, eps)),
                                                  product(up, mx.fast.rms_norm(y, nw, eps))), h, reps)
            nbytes = sum(a.nbytes for a in (*gate, *up))
        else:
            mlx_us = per_product(lambda y: [product(layer, mx.fast.rms_norm(y, nw, eps)) for layer in layers], h, reps)
            nbytes = sum(a.nbytes for layer in layers for a in layer)
        times, ok = {}, {}
        for variant, env in VARIANTS.items():
            os.environ.update(env)  # read as each kernel is built (at its first run below) and by agrees
            # (prepared, rounded: only the shapes each takes, one chunk a lane, K whole (rounded: more chunks
            # too under GMLX_Q8_DEPTH=1); the others' kernels are the same)
            for c in configs if not variant else [c for c in configs if takes(variant, *qgemv_cuda.launch_shape(c)[3:])]:
                if kind == "gated":
                    run = qgemv_cuda.bound(*gate, g, bits, c, up=up, norm=(nw, eps))
                    ok[variant] = ok.get(variant, True) and agrees(run(h), want_glu, exact_glu, qgemv_q8.tolerance(bits))
                else:
                    run = qgemv_cuda.bound(*layers[0], g, bits, c, more=tuple(layers[1:]), norm=(nw, eps))
                    ok[variant] = ok.get(variant, True) and all(
                        agrees(got, w, e, qgemv_q8.tolerance(bits))
                        for got, w, e in zip(run(h), want_parts, exact_parts, strict=True))
                times[(c, variant)] = per_product(run, h, reps)
            for name in env:
                os.environ.pop(name, None)
        best = min(times, key=times.get)
        shapes = ", ".join(f"{_shape(c)}{' ' + variant if variant else ''}: {t:.1f}" for (c, variant), t in times.items())
        name = f"{k}x{n} gate+up, swiglu, normed" if kind == "gated" else f"{k}x{'+'.join(map(str, sizes))} parts, normed"
        agreed = ", ".join(f"{variant or 'default'} {'yes' if good else 'NO'}" for variant, good in ok.items())
        out.append(f"| {name} | {bits} | 1 | {agreed} | {mlx_us:.1f} | {times[best]:.1f} | "
                   f"{mlx_us / times[best]:.2f} | {nbytes / times[best] / 1e3:.0f} | {shapes} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rows", default="1", help="comma-separated rows of x (1-8)")
    p.add_argument("--gated", action="store_true", help="the gated MLP product instead (glu_cuda)")
    p.add_argument("--qkv", action="store_true", help="the attention's parts product instead (qkv_cuda)")
    p.add_argument("--device", action="store_true",
                   help="time the device's part alone (each chain behind a lead product), not the chain's clock")
    p.add_argument("--shapes", default="",
                   help="the plain products' shapes alone, comma-separated KxNxBITS (e.g. 14336x4096x6)")
    p.add_argument("--normed", action="store_true",
                   help="the gated and parts products with the norm folded in: x made by each warp, prepared or rounded")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    g = args.group
    if args.device:
        CLOCK[0] = device_chain_time
    print(f"device {mx.default_device()}; x and scales {args.dtype}, group {g}; us per product, "
          f"{args.reps} queued per wait, best of 3{', the device part alone' if args.device else ''}")
    print("| K x N | bits | rows | agrees | MLX us | kernel us (best shape) | x MLX | kernel GB/s | per shape |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---|")
    if args.normed:
        for line in normed_rows(4096, 14336, (4096, 1024, 1024), 4, dtype, g, args.reps):
            print(line, flush=True)
        return
    for rows in (int(r) for r in args.rows.split(",")):
        if args.gated:
            print(gated_row(4096, 14336, 4, dtype, g, args.reps, rows), flush=True)
            continue
        if args.qkv:
            print(parts_row(4096, (4096, 1024, 1024), 4, dtype, g, args.reps, rows), flush=True)
            print(parts_row(4096, (4096, 1024), 4, dtype, g, args.reps, rows), flush=True)
            continue
        chosen = [tuple(int(v) for v in c.split("x")) for c in args.shapes.split(",") if c] or SHAPES
        for k, n, bits in chosen:
            print(row(k, n, bits, dtype, g, args.reps, rows), flush=True)


if __name__ == "__main__":
    main()
