"""What a kernel costs the host on MLX's CUDA backend, and what a decode step of an 8B
model costs with MLX's CUDA-graph settings varied and with gmlx's stacked projections
(``gmlx.engine.kernels.fused``) off and on: one child process per setting (MLX reads
them once), each building step_check's in-memory Llama-3-8B in Q4_K_M's layouts (no
model files: run it right after ``setup.sh install``).

    python benchmarks/gpu/launch_cost.py [--widths 1,8,32] [--settings default,ops80,nographs] [--tuned]
    python benchmarks/gpu/launch_cost.py --shape tiny --widths 1,4   # here, on the CPU

Rows: the setting, stacked or not, the decode width, ms per step (each waited for), of
it ms building the graph (Python) and handing it over (``mx.async_eval``), tok/s; and per
setting, a chain of 512 one-kernel operations on a 4,096-element row: microseconds per
operation to build, to hand over, and in all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "default": {},
    "ops40": {"MLX_MAX_OPS_PER_BUFFER": "40"},
    "ops80": {"MLX_MAX_OPS_PER_BUFFER": "80"},
    "ops200": {"MLX_MAX_OPS_PER_BUFFER": "200"},
    "nographs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def chain_cost(n: int = 512, reps: int = 5) -> tuple[float, float, float]:
    """Microseconds per operation of a chain of ``n`` adds: building, handing over, all."""
    import mlx.core as mx

    x = mx.zeros((1, 4096), mx.bfloat16)
    mx.eval(x)
    best = (float("inf"),) * 3
    for _ in range(reps):
        t = time.perf_counter()
        y = x
        for _ in range(n):
            y = y + 1.0
        t2 = time.perf_counter()
        mx.async_eval(y)
        t3 = time.perf_counter()
        mx.eval(y)
        t4 = time.perf_counter()
        run = ((t2 - t) / n * 1e6, (t3 - t2) / n * 1e6, (t4 - t) / n * 1e6)
        best = min(best, run, key=lambda r: r[2])
    return best


def child(shape: str, widths: list[int], stack: bool) -> None:
    import mlx.core as mx

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.served_step import bare_step
    from benchmarks.gpu.step_check import build
    from gmlx.engine.kernels import prepare_layers

    rows = []
    model = build(shape, "float16")
    for stacked in (False, True) if stack else (False,):
        if stacked:
            os.environ["GMLX_FUSE_PROJECTIONS"] = "1"
        else:
            os.environ["GMLX_FUSE_PROJECTIONS"] = "0"
        notes = prepare_layers(model)
        from gmlx.engine.kernels.fused import FusedPart

        notes.append(f"{sum(isinstance(m, FusedPart) for _, m in model.named_modules())} stacked parts")
        for width in widths:
            step, build_s, launch = bare_step(model, width)
            rows.append({"stacked": stacked, "width": width, "step": step * 1e3, "build": build_s * 1e3,
                         "launch": launch * 1e3, "tok_s": width / step, "notes": notes})
        mx.clear_cache()
    print("RESULT " + json.dumps({"rows": rows, "chain": chain_cost(), "device": str(mx.default_device())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--widths", default="1,8,32")
    parser.add_argument("--settings", default="default,ops80,ops200,nographs")
    parser.add_argument("--tuned", action="store_true",
                        help="the quantized layers' tuned paths, as a server runs (default: only flattened, "
                             "GMLX_QMV_KERNEL=flat: no minutes of tuning per setting)")
    parser.add_argument("--unstacked", action="store_true", help="only the model as loaded (no stacked pass)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        return child(args.shape, widths, not args.unstacked)
    print(f"{'setting':>9} {'stacked':>7} {'width':>5} {'step ms':>8} {'build ms':>9} {'launch ms':>9} "
          f"{'tok/s':>8} {'x unstacked':>11}", flush=True)
    chains = {}
    for name in args.settings.split(","):
        env = {**os.environ, **SETTINGS[name], "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               "GMLX_QMV_KERNEL": "1" if args.tuned else "flat"}
        proc = subprocess.run([sys.executable, __file__, "--child", "--shape", args.shape, "--widths", args.widths,
                               *(["--unstacked"] if args.unstacked else [])],
                              env=env, capture_output=True, text=True, check=False)
        result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
        if result is None:
            print(f"{name:>9}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        base = {r["width"]: r["tok_s"] for r in result["rows"] if not r["stacked"]}
        for r in result["rows"]:
            print(f"{name:>9} {'yes' if r['stacked'] else 'no':>7} {r['width']:>5} {r['step']:>8.2f} "
                  f"{r['build']:>9.2f} {r['launch']:>9.2f} {r['tok_s']:>8.1f} "
                  f"{r['tok_s'] / base[r['width']]:>11.2f}", flush=True)
        chains[name] = result["chain"]
        notes = {n for r in result["rows"] for n in r["notes"]}
        print(f"{'':>9} device {result['device']}; notes: {'; '.join(sorted(notes))}", flush=True)
    print(f"\n{'setting':>9} {'build us/op':>12} {'launch us/op':>13} {'all us/op':>10}  (a chain of 512 adds)")
    for name, (b, launch, total) in chains.items():
        print(f"{name:>9} {b:>12.2f} {launch:>13.2f} {total:>10.2f}")


if __name__ == "__main__":
    main()
