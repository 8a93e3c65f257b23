"""gmlx's settings compared by the served step's own GPU time, not by served tok/s.

Why: one stream served by the same gmlx build on the same file ran 198.8-261.7 tok/s from
process to process in one lease (H100, 12-06), so a served pair cannot show a change of
a few percent, and settings that remove a few microseconds a layer (a folded rope, a
shorter attention build, the q-k-v product at one row) stayed off for want of a verdict.
The step's kernels traced (``kernel_times.py --loops served --trace``: the layers loaded
as a server loads them, its tuning read from ``GMLX_HOME``) give the GPU's busy time a
step, which moves far less between processes than the host does.

    GMLX_HOME=/tmp/gmlx-home python3 benchmarks/gpu/step_variants.py \\
        /tmp/models/llama3-8b/q4_k_m.gguf --variants gmlx,gmlx-qkv,gmlx-fold --rounds 2

Each round runs every variant once, in order, each in a process of its own (its
environment from ``bench.py``'s variants; ``gmlx`` is the defaults). It prints a row a
run as it finishes, then per variant the median of its runs and that against ``gmlx``'s:
ms a step (pipelined, the host included), the traced span, the GPU busy, the kernels'
sum and their count a step."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.bench import GMLX_VARIANTS

KERNEL_TIMES = Path(__file__).with_name("kernel_times.py")
COLUMNS = ("ms a step", "span", "GPU busy", "kernels", "kernels a step")
_WALL = re.compile(r"^window (\d+) width (\d+) loop served: ([\d.]+) ms a step", re.MULTILINE)
_TRACED = re.compile(r"^window (\d+) \(traced\): span ([\d.]+) ms a step, kernels ([\d.]+) ms, "
                     r"the GPU busy ([\d.]+) ms .*?; (\d+) kernels a step", re.MULTILINE)


def environment(variant: str) -> dict[str, str]:
    """The settings ``variant`` adds to this process's environment (``gmlx``: none)."""
    if variant == "gmlx":
        return {}
    if variant not in GMLX_VARIANTS:
        raise SystemExit(f"step_variants: no variant {variant!r} (bench.py's: gmlx, {', '.join(GMLX_VARIANTS)})")
    return dict(GMLX_VARIANTS[variant])


def parse(output: str) -> dict[int, tuple[float, ...]]:
    """Per width, a run's ``COLUMNS`` from ``kernel_times.py --loops served --trace``'s
    output: each window's wall line and its traced line, joined by the window's index."""
    widths = {int(m[1]): (int(m[2]), float(m[3])) for m in _WALL.finditer(output)}
    rows = {}
    for m in _TRACED.finditer(output):
        if int(m[1]) in widths:
            width, wall = widths[int(m[1])]
            rows[width] = (wall, float(m[2]), float(m[4]), float(m[3]), float(m[5]))
    return rows


def summary(runs: dict[str, dict[int, list[tuple[float, ...]]]]) -> list[str]:
    """Markdown: per width and variant, the median of each column over its runs, and the
    ms a step and GPU busy as a fraction of ``gmlx``'s (where it ran)."""
    lines = ["| width | variant | runs | " + " | ".join(COLUMNS) + " | ms a step / gmlx | GPU busy / gmlx |",
             "|---:|---|---:|" + "---:|" * (len(COLUMNS) + 2)]
    for width in sorted({w for by_width in runs.values() for w in by_width}):
        medians = {v: tuple(statistics.median(col) for col in zip(*by_width[width], strict=True))
                   for v, by_width in runs.items() if by_width.get(width)}
        base = medians.get("gmlx")
        for variant, med in medians.items():
            ratio = (f"{med[0] / base[0]:.3f} | {med[2] / base[2]:.3f}" if base else "— | —")
            lines.append(f"| {width} | {variant} | {len(runs[variant][width])} | "
                         f"{med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} | {med[4]:.0f} | {ratio} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model file gmlx serve takes (its tuning from GMLX_HOME), or synthetic:SHAPE")
    p.add_argument("--variants", default="gmlx,gmlx-qkv,gmlx-fold",
                   help="comma-separated: gmlx (the defaults) and bench.py's gmlx-* variants")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--widths", default="1")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--timeout", type=float, default=150, help="seconds a run may take")
    p.add_argument("--keep", type=Path, help="a folder for each run's whole output")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    envs = {v: environment(v) for v in variants}  # an unknown name fails before any run
    runs: dict[str, dict[int, list[tuple[float, ...]]]] = {v: {} for v in variants}
    print("| round | variant | width | " + " | ".join(COLUMNS) + " | s |", flush=True)
    print("|---:|---|---:|" + "---:|" * (len(COLUMNS) + 1), flush=True)
    for round_ in range(1, args.rounds + 1):
        for variant in variants:
            started = time.perf_counter()
            command = [sys.executable, str(KERNEL_TIMES), args.model, "--widths", args.widths, "--loops", "served",
                       "--steps", str(args.steps), "--trace", "--dtype", args.dtype]
            try:
                done = subprocess.run(command, env={**os.environ, **envs[variant]}, capture_output=True, text=True,
                                      timeout=args.timeout, check=False)
                output = done.stdout + done.stderr
            except subprocess.TimeoutExpired as cut:
                output = f"cut off at {args.timeout:.0f} s\n" + (cut.stdout or b"").decode(errors="replace")
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"{variant}-{round_}.txt").write_text(output)
            rows = parse(output)
            if not rows:
                print(f"| {round_} | {variant} | — | no step timed: {output.strip().splitlines()[-1:]} |", flush=True)
            for width, row in sorted(rows.items()):
                runs[variant].setdefault(width, []).append(row)
                print(f"| {round_} | {variant} | {width} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {row[3]:.2f} | "
                      f"{row[4]:.0f} | {time.perf_counter() - started:.0f} |", flush=True)
    print("\n" + "\n".join(summary(runs)), flush=True)


if __name__ == "__main__":
    main()
