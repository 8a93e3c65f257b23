"""Whether a decode step is bound by the GPU's kernels or by what surrounds them: one
step's kernels timed one by one by NVIDIA's Nsight Compute (``ncu``, in the CUDA toolkit
of the GPU machine), summed by kernel, beside the same step's wall time pipelined as a
server decodes (``pipeline_check``'s ``one token`` loop and its layer variants).

Why: ``pipeline_check`` splits a step's host time into building the graph and handing it
over (``mx.async_eval``), but MLX's hand-over also waits for the GPU once more than ten
command buffers are in flight (its ``eval`` throttle), so a long hand-over may be the GPU's
time as much as the host's. If the kernels' sum is close to the wall time, the step is
the GPU's (faster kernels, fewer small ones); if far below, it is the host's or the gaps
between kernels (fewer operations, fewer launches).

    python benchmarks/gpu/kernel_times.py synthetic:llama3-8b --widths 1,8 \\
        --loops "one token,all kernels"

runs the child twice per (width, loop) set: once plain (wall ms per step) and once under
``ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum`` (the
GPU's own clocks, as a server's steps run, where ncu would lock them at base), the profiled window
opened (``cudaProfilerStart``) around ``--steps`` steps after a warm-up, each window
begun by a marker kernel so the rows split by window. The quantized layers are MLX's
products flattened (``GMLX_QMV_KERNEL=flat``: what the tuner starts from), but in the
``tuned`` loops: there they take the paths a server's load gives them (its tuning read
from ``GMLX_HOME``, or timed first), and the step kernels (``glu_cuda``, ``qkv_cuda``)
run where that tuning takes them; ``tuned whole`` adds the compiled blocks, the in-place
attention and the whole step. ``served`` (a loop alone) loads the layers exactly as a
server does (``prepare_layers``: its tuning read from ``GMLX_HOME`` under the server's
own keys, not confirmed again in this script's forms, which on 12-06 dropped the one-row
paths the server had taken): the served step's own kernels.
``--ncu PATH`` names the profiler; ``--csv FILE`` only reads an earlier run's output.
``--sections N`` prints ncu's own report (speed of light, memory, the warps' stall
reasons, launch, occupancy) for the first N launches of gmlx's products and attention
inside the windows: why a product reads at a fraction of the card's bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import glob
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MARKER = "gmlx_window_marker"
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def _profiler(start: bool) -> None:
    """Open or close ncu's profiled window: CUDA's runtime beside the Python packages (MLX's
    own is not exposed), else the driver's (``cuProfilerStart``, on this thread's context)."""
    for pattern in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"):
        for folder in sys.path:
            for path in sorted(glob.glob(os.path.join(folder, pattern))):
                lib = ctypes.CDLL(path)
                (lib.cudaProfilerStart if start else lib.cudaProfilerStop)()
                return
    lib = ctypes.CDLL("libcuda.so.1")
    (lib.cuProfilerStart if start else lib.cuProfilerStop)()


def marker(index: int) -> None:
    """A kernel whose name says a window begins (``index``), run and waited for."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=f"{MARKER}_{index}", input_names=["a"], output_names=["b"],
                                 source="if (threadIdx.x == 0) b[0] = a[0];")
    out = kernel(inputs=[mx.zeros((1,), mx.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
    mx.eval(out)


def child(args: argparse.Namespace) -> None:
    """Every (width, loop): a warm-up, then ``steps`` pipelined steps, timed (and, under
    ncu, profiled); prints one line per window."""
    import mlx.core as mx

    from benchmarks.gpu.pipeline_check import _primed
    from benchmarks.gpu.served_step import attention, layered, load, pipelined
    from gmlx.engine.kernels import cuda_source, fast_linear, glu_cuda, qkv_cuda
    from gmlx.engine.mlxlm import greedy_argmax

    loaded = load(args.model, args.dtype)
    served = "served" in args.loops.split(",")
    if served:  # the server's own load, nothing of this script's layering
        if args.loops != "served":
            raise SystemExit("kernel_times: the served loop runs alone (its layers stay as the load left them)")
        from gmlx.engine.kernels import prepare_layers

        print(f"served: {prepare_layers(loaded.model)}", flush=True)
    else:
        os.environ["GMLX_QMV_KERNEL"] = "flat"
        fast_linear.use_fast_kernels(loaded.model)
    tuned: dict[int, dict] = {}  # the load tuner's paths per layer, for the "tuned" loop
    if any(mode.startswith("tuned") for mode in args.loops.split(",")):
        os.environ["GMLX_QMV_KERNEL"] = "1"  # read from GMLX_HOME's tuning, or timed now
        print(f"tuned: {fast_linear.use_fast_kernels(loaded.model)}", flush=True)
        tuned = {id(m): dict(m.paths) for _, m in loaded.model.named_modules()
                 if isinstance(m, fast_linear.FastQuantizedLinear)}
    if not served:
        attention(True)
    profiled = args.profiled and cuda_source.available()
    tracer = _Tracer(args.torch_site) if args.trace else None
    index = 0
    for width in (int(w) for w in args.widths.split(",")):
        for mode in args.loops.split(","):
            for _, m in loaded.model.named_modules():
                if id(m) in tuned:
                    m.set_paths(dict(tuned[id(m)]) if mode.startswith("tuned") else {})
            with contextlib.nullcontext() if served else layered(loaded.model, mode):
                if mode.startswith("tuned"):  # the step kernels where the load's tuning takes them
                    for kernel in (glu_cuda, qkv_cuda):
                        print(f"tuned: {kernel.tune(loaded.model)}", flush=True)
                cache, current = _primed(loaded.model, width, 128, "gmlx cache")

                def step(tokens, cache=cache):
                    return greedy_argmax(loaded.model(tokens[:, None], cache=cache)[:, -1, :])  # as served

                for _ in range(4):  # compiles and allocations
                    current = step(current)
                    mx.eval(current)
                if profiled:
                    _profiler(True)
                    marker(index)
                with tracer.window(index) if tracer else contextlib.nullcontext():
                    elapsed = pipelined(step, current, args.steps)
                if profiled:
                    _profiler(False)
            print(f"window {index} width {width} loop {mode}: {elapsed / args.steps * 1e3:.2f} ms a step", flush=True)
            index += 1
    if tracer:
        tracer.report(args.steps, args.top)


class _Tracer:
    """Each window's kernels as PyTorch's profiler records them (CUPTI's activity records
    of every kernel in the process, MLX's included, with their start and end: no replay,
    so the gaps between kernels are real). PyTorch comes from ``site`` (the GPU machine's
    own install, appended to the path): gmlx's environment has none."""

    def __init__(self, site: str) -> None:
        sys.path.append(site)
        import torch  # noqa: F401  (fails here, before any window, if it cannot load)

        self.windows: dict[int, list[tuple[str, float, float]]] = {}

    @contextlib.contextmanager
    def window(self, index: int):
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
        self.windows[index] = sorted((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                     if e.device_type == DeviceType.CUDA)

    def report(self, steps: int, top: int) -> None:
        """Per window: the kernels' sum, the time the GPU ran any kernel (their union),
        the gaps between kernels, and the dearest kernels."""
        for index, kernels in sorted(self.windows.items()):
            if not kernels:
                print(f"\nwindow {index}: the profiler saw no kernel (CUPTI did not reach MLX's launches)")
                continue
            kernels.sort(key=lambda k: k[1])
            busy, end, gaps = 0.0, kernels[0][1], []
            for _, start, stop in kernels:
                if start > end:
                    gaps.append(start - end)
                busy += max(0.0, stop - max(start, end))
                end = max(end, stop)
            span = end - kernels[0][1]
            total = sum(stop - start for _, start, stop in kernels)
            gaps.sort()
            median = gaps[len(gaps) // 2] if gaps else 0.0
            print(f"\nwindow {index} (traced): span {span / steps / 1e3:.2f} ms a step, kernels {total / steps / 1e3:.2f} "
                  f"ms, the GPU busy {busy / steps / 1e3:.2f} ms ({busy / span:.0%} of the span); "
                  f"{len(kernels) / steps:.0f} kernels a step, gaps median {median:.1f} us, "
                  f"{sum(gaps) / steps / 1e3:.2f} ms a step in all")
            by_name: dict[str, list[float]] = {}
            for name, start, stop in kernels:
                acc = by_name.setdefault(name.split("(")[0].split("<")[0].strip()[:70], [0.0, 0])
                acc[0] += stop - start
                acc[1] += 1
            print("| kernel | a step | us a step | us each |")
            print("|---|---:|---:|---:|")
            for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
                print(f"| {name} | {n / steps:.1f} | {us / steps:.0f} | {us / n:.1f} |")


TIME = "gpu__time_duration.sum"
# how near each kernel runs to the memory's and the SMs' peak (each costs ncu a replay)
BOUND = ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed")

# what --sections asks ncu for, a replay each
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
            "LaunchStats", "Occupancy")

Row = tuple[float, float, float | None, float | None]  # us a step, launches a step, DRAM %, SM %


def kernel_table(path: Path, steps: int) -> dict[int, dict[str, Row]]:
    """Per window, each kernel's microseconds a step, launches a step and (where ncu
    measured them) its DRAM and SM throughput in % of peak, weighted by time, from ncu's
    CSV (one row per kernel and metric)."""
    lines = path.read_text(errors="replace").splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        raise SystemExit(f"kernel_times: no ncu table in {path}: " + " | ".join(lines[-5:]))
    launches: dict[str, dict] = {}  # ncu's launch ID -> its name and metrics, in order
    for row in csv.DictReader(lines[header:]):
        launch = launches.setdefault(row["ID"], {"name": row["Kernel Name"]})
        value = float(row["Metric Value"].replace(",", "") or 0)
        launch[row["Metric Name"]] = value * (UNITS.get(row["Metric Unit"], 1.0) if row["Metric Name"] == TIME else 1)
    sums: dict[tuple[int, str], list[float]] = {}  # us, launches, DRAM % x us, SM % x us, us with %
    window = -1
    for launch in launches.values():
        full = launch["name"]
        if MARKER in full:
            window = int(full.split(MARKER + "_")[1].split("_")[0].split("(")[0].split("<")[0])
            continue
        if TIME not in launch:
            continue
        name = full.split("(")[0].split("<")[0].strip()[:70]
        us = launch[TIME]
        acc = sums.setdefault((window, name), [0.0, 0, 0.0, 0.0, 0.0])
        acc[0] += us
        acc[1] += 1
        if all(m in launch for m in BOUND):
            acc[2] += launch[BOUND[0]] * us
            acc[3] += launch[BOUND[1]] * us
            acc[4] += us
    table: dict[int, dict[str, Row]] = {}
    for (w, name), (us, n, dram, sm, weighed) in sums.items():
        table.setdefault(w, {})[name] = (us / steps, n / steps, dram / weighed if weighed else None,
                                         sm / weighed if weighed else None)
    if not set(table) - {-1}:
        raise SystemExit(f"kernel_times: ncu timed no kernel inside a window ({len(sums)} kinds outside): the "
                         "profiler start did not reach MLX's context; run ncu without --profile-from-start off")
    return table


def report(walls: list[str], table: dict[int, dict[str, Row]], top: int) -> None:
    """Each window's kernels' sum beside its wall time (where known), and its dearest
    kernels with how near they run to the memory's and the SMs' peak."""
    names = dict(enumerate(walls))
    for index in sorted(set(names) | set(table) - {-1}):
        kinds = table.get(index, {})
        total = sum(row[0] for row in kinds.values()) / 1e3
        line = names.get(index, f"window {index}: ? ms a step")
        wall = line.split(": ")[1].split()[0]
        ratio = f"{total / float(wall):.2f}" if wall != "?" else "?"
        print(f"\n{line.split(':')[0]}: wall {wall} ms a step, kernels {total:.2f} ms "
              f"({sum(row[1] for row in kinds.values()):.0f} a step): kernels / wall {ratio}")
        print("| kernel | a step | us a step | us each | DRAM % of peak | SM % of peak |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, (us, n, dram, sm) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]:
            pct = " | ".join("" if v is None else f"{v:.0f}" for v in (dram, sm))
            print(f"| {name} | {n:.0f} | {us:.0f} | {us / n:.1f} | {pct} |")


def _profile(command: list[str], limit: float | None) -> tuple[str, int | None]:
    """Run ``command`` (ncu and the child) in a session of its own; its output and exit
    status, or None for the status when it ran past ``limit`` seconds and was stopped
    (ncu has written the kernels it profiled by then)."""
    import signal

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=limit)
        return stdout, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        return stdout, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model reference gmlx serve takes, or synthetic:SHAPE")
    p.add_argument("--widths", default="1,8")
    p.add_argument("--loops", default="one token,all kernels")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--csv", help="read this ncu output instead of running the profiler")
    p.add_argument("--time-only", action="store_true",
                   help="only each kernel's time (no DRAM and SM throughput: one replay a kernel, faster)")
    p.add_argument("--no-plain", action="store_true",
                   help="skip the unprofiled run (the windows' wall times then come from under ncu)")
    p.add_argument("--limit", type=float, default=None,
                   help="seconds the profiled run may take; past them it is stopped and the windows "
                        "ncu finished are reported")
    p.add_argument("--trace", action="store_true",
                   help="no ncu: one process, each window traced by PyTorch's profiler (real start and end "
                        "of every kernel: the GPU's busy time and the gaps between kernels)")
    p.add_argument("--torch-site", default="/opt/torch/.venv/lib/python3.12/site-packages",
                   help="where --trace imports PyTorch from (the GPU machine's own)")
    p.add_argument("--sections", type=int, default=0, metavar="N",
                   help="instead of the table: the first N launches of gmlx's one-row products (and the "
                        "attention) inside the windows under ncu's sections (the SMs' and memory's speed of "
                        "light, the warps' stall reasons, launch and occupancy), its report printed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child or args.trace:
        child(args)
        return
    common = [sys.executable, __file__, args.model, "--child", "--widths", args.widths, "--loops", args.loops,
              "--steps", str(args.steps), "--dtype", args.dtype]
    walls: list[str] = []
    if not args.no_plain:
        plain = subprocess.run(common, capture_output=True, text=True, check=False)
        walls = [line for line in plain.stdout.splitlines() if line.startswith("window ")]
        if plain.returncode or not walls:
            raise SystemExit("kernel_times: the plain run failed: " + plain.stderr[-2000:])
        print("\n".join(walls), flush=True)
    if args.sections:
        # why a product reads at a fraction of the card's bandwidth: latency (the warps
        # stalled on loads, few bytes in flight), occupancy or the SMs' own work
        stdout, code = _profile([args.ncu, "--profile-from-start", "off", "--clock-control", "none",
                                 "--kernel-name", "regex:gmlx_(q|attend)", "--launch-count", str(args.sections),
                                 *[arg for s in SECTIONS for arg in ("--section", s)], *common, "--profiled"],
                                args.limit)
        print(stdout if code is not None else f"kernel_times: ncu cut off at {args.limit:.0f} s\n" + stdout)
        return
    out = Path(args.csv or "/tmp/kernel_times.csv")
    code: int | None = 0
    if not args.csv:
        metrics = ",".join((TIME,) if args.time_only else (TIME, *BOUND))
        stdout, code = _profile([args.ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics", metrics,
                                 "--csv", "--log-file", str(out), *common, "--profiled"], args.limit)
        if code is None:
            print(f"kernel_times: ncu cut off at {args.limit:.0f} s; the windows it finished:", flush=True)
        elif code:
            raise SystemExit("kernel_times: ncu failed: " + stdout[-2000:])
        walls = walls or [line for line in stdout.splitlines() if line.startswith("window ")]
    table = kernel_table(out, args.steps)
    if code is None:  # the last window ncu began may be cut short
        table.pop(max(table), None)
        walls = [line for line in walls if int(line.split()[1]) in table]
    report(walls, table, args.top)


if __name__ == "__main__":
    main()
