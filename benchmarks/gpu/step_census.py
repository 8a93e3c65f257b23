"""What one decode step hands MLX, primitive by primitive, and what handing it over costs
the host: the served step's graph (the layers as a server's load leaves them, the greedy
token taken as the worker takes it) counted by primitive from MLX's own graph export,
beside the step's build (Python) and hand-over (``mx.async_eval``) times, so the hand-over
can be read as microseconds a primitive. With ``--loop`` the step then runs pipelined
for that many seconds, with ``--spy PATH`` under py-spy (``--native``: MLX's C++ and the
CUDA runtime's functions too, every thread; speedscope JSON) for the loop alone, so the
profile is the steps', not the load's (``lease.sh census``: where MLX's CUDA backend
spends the hand-over).

Why: a one-stream step of the 8B on the H100 handed 165 kernels over in 1.70 ms (12-07),
~10 us a kernel where MLX's own call of one custom kernel costs ~3 (``call_cost.py``);
what else the graph holds (views, copies, constants made again each step) is host time
that no kernel shows.

    python benchmarks/gpu/step_census.py synthetic:llama3-8b [--widths 1,8] [--loop 20 --spy native.json]
    python benchmarks/gpu/step_census.py demo --widths 1,4      # here, on the CPU
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# primitives MLX evaluates without a kernel where their input is contiguous (a view of it)
VIEWS = frozenset({"AsStrided", "Broadcast", "ExpandDims", "Flatten", "Reshape", "Slice", "Squeeze", "Transpose",
                   "Unflatten", "StopGradient"})


def census(*outputs: mx.array) -> Counter[str]:
    """The primitives of ``outputs``' graph, unevaluated, by name (MLX's fused element-wise
    kernels under one name, ``Compiled``)."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(dot), *outputs)
        labels = re.findall(r'label ="([^"]+)"', dot.read_text())
    return Counter("Compiled" if name.startswith("Compiled") else name for name in labels)


def timed(step, rows: int, steps: int) -> tuple[Counter[str], float, float]:
    """The step's census (after a few untimed steps: traces and kernels made) and the
    medians of ``steps`` steps' build and hand-over, in seconds, each step waited for."""
    current = mx.zeros((rows,), mx.int32)
    for _ in range(4):
        current = step(current)
        mx.eval(current)
    # a step built and dropped: the cache's position moves past a key never written, which
    # the steps timed after attend to as to any other (their time is the same; their tokens
    # are not read)
    counted = census(step(current))
    builds, handovers = [], []
    for _ in range(steps):
        t = time.perf_counter()
        nxt = step(current)
        t2 = time.perf_counter()
        mx.async_eval(nxt)
        handovers.append(time.perf_counter() - t2)
        builds.append(t2 - t)
        mx.eval(nxt)
        current = nxt
    return counted, statistics.median(builds), statistics.median(handovers)


def loop(step, rows: int, seconds: float, chunk: int = 64) -> int:
    """The step pipelined as the worker runs it (:func:`served_step.pipelined`: the next
    handed over before this one's tokens are read) in runs of ``chunk`` steps until
    ``seconds`` have passed; the steps run."""
    from benchmarks.gpu.served_step import pipelined

    current = mx.zeros((rows,), mx.int32)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        pipelined(step, current, chunk)
        n += chunk
    return n


def report(width: int, counted: Counter[str], build: float, handover: float) -> str:
    total = sum(counted.values())
    views = sum(n for name, n in counted.items() if name in VIEWS)
    head = (f"width {width}: {total} primitives ({views} views), build {build * 1e3:.2f} ms, "
            f"hand over {handover * 1e3:.2f} ms: {handover * 1e6 / max(total, 1):.1f} us a primitive")
    lines = [head, "| primitive | a step |", "|---|---:|"]
    lines += [f"| {name}{' (view)' if name in VIEWS else ''} | {n} |" for name, n in counted.most_common()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model reference gmlx serve takes, or synthetic:SHAPE (served_step.py's)")
    p.add_argument("--widths", default="1")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the steps")
    p.add_argument("--steps", type=int, default=64, help="steps timed a width")
    p.add_argument("--dtype", default="float16", help="synthetic: float type")
    p.add_argument("--loop", type=float, default=0.0, help="then seconds of pipelined steps at the first width")
    p.add_argument("--spy", type=Path, help="with --loop: the loop recorded by py-spy --native into this file")
    args = p.parse_args()

    from benchmarks.gpu.profile_summary import record, stop
    from benchmarks.gpu.served_step import greedy_step, load
    from gmlx.engine.kernels import prepare_layers

    # the load's own lines too (what it stacked, which folds it took: `folded ... in N of 32`)
    logging.basicConfig(format="  log: %(message)s", level=logging.WARNING)
    logging.getLogger("gmlx.engine.kernels").setLevel(logging.INFO)
    loaded = load(args.model, args.dtype)
    notes = prepare_layers(loaded.model)
    print(f"device: {mx.default_device()}  model: {args.model}; {len(notes)} load note(s)", flush=True)
    for note in notes:  # (which folds the load took: a census of more kernels than a trace's says why)
        print(f"  note: {note}", flush=True)
    widths = [int(w) for w in args.widths.split(",")]
    for width in widths:
        step = greedy_step(loaded.model, width, args.context)
        print(report(width, *timed(step, width, args.steps)), flush=True)
    if args.loop:
        step = greedy_step(loaded.model, widths[0], args.context)
        spy = record(os.getpid(), args.spy, idle=False)
        t = time.perf_counter()
        n = loop(step, widths[0], args.loop)
        print(f"loop: {n} steps of {widths[0]} in {time.perf_counter() - t:.1f} s"
              f"{f', recorded into {args.spy}' if spy else ''}", flush=True)
        stop(spy)


if __name__ == "__main__":
    main()
