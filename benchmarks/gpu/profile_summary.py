"""Where each thread's time went, from py-spy's speedscope profiles (bench.py --profile,
ttft_profile.py --profile, lease.sh census): per thread its samples, the functions it was
in last (self time) and the functions of the servers' own code it was inside (inclusive
time); with ``--native``, the compiled libraries' functions it was inside too (a profile
taken with py-spy ``--native``: MLX's C++, the CUDA runtime), a library's unnamed
addresses under the library's name. :func:`record` and :func:`stop` take such a profile
of a running process (bench.py's servers, step_census.py's own loop).

    python benchmarks/gpu/profile_summary.py PROFILE.json [PROFILE.json ...] [--top 12] [--native]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

OWN = ("gmlx/", "mlx_lm/", "uvicorn/", "starlette/", "fastapi/", "anyio/", "asyncio/")


def label(frame: dict) -> str:
    file = frame.get("file") or ""
    short = "/".join(file.split("/")[-2:]) if file else ""
    return f"{frame['name']} ({short}:{frame.get('line', '')})" if short else frame["name"]


def record(pid: int, out: Path | None, rate: int = 500, native: bool = True, gil: bool = False,
           idle: bool = True) -> subprocess.Popen | None:
    """py-spy recording process ``pid`` from now until :func:`stop`, every thread, as
    speedscope JSON in ``out``: with ``gil`` only the thread holding the interpreter at
    each sample (which thread's Python a step waits behind), else with ``idle`` the idle
    samples too (where each thread's wall time goes); ``native``: the compiled libraries'
    frames too. None without a path or py-spy."""
    if out is None or not shutil.which("py-spy"):
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    which = ["--gil"] if gil else ["--idle"] if idle else []
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--threads", *which,
                            *(["--native"] if native else []), "--format", "speedscope", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(1.0)  # attached before what is to be recorded starts
    return spy


def stop(spy: subprocess.Popen | None, timeout: float = 60.0) -> None:
    """End a :func:`record`: py-spy writes the profile and exits (killed past ``timeout``)."""
    if spy is None:
        return
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout)
    except subprocess.TimeoutExpired:
        spy.kill()


def native(frame: dict) -> str | None:
    """A compiled library's frame by its function's name (its parameters dropped), or by
    the library's where the address has no name; None for Python's frames."""
    file = frame.get("file") or ""
    if not file or file.endswith(".py") or file.startswith("<"):
        return None
    name = frame["name"]
    return file.rsplit("/", 1)[-1] if name.startswith("0x") else name.split("(", 1)[0]


def summarize(path: Path, top: int, natives: bool = False) -> str:
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    lines = [f"## {path.name}"]
    profiles = sorted(data["profiles"], key=lambda p: -sum(p.get("weights") or [1] * len(p["samples"])))
    for prof in profiles:
        samples = prof["samples"]
        weights = prof.get("weights") or [1] * len(samples)
        total = sum(weights)
        if not total:
            continue
        leaf: Counter[str] = Counter()
        inside: Counter[str] = Counter()
        inside_native: Counter[str] = Counter()
        for stack, w in zip(samples, weights, strict=True):
            if stack:
                leaf[label(frames[stack[-1]])] += w
            seen = {label(frames[i]) for i in stack if any(o in (frames[i].get("file") or "") for o in OWN)}
            for name in seen:
                inside[name] += w
            if natives:
                for name in {n for i in stack if (n := native(frames[i]))}:
                    inside_native[name] += w
        lines.append(f"\n### thread {prof['name']}: {total:.2f} {prof.get('unit', 'samples')}")
        lines.append("self: " + "; ".join(f"{n} {c / total:.1%}" for n, c in leaf.most_common(top)))
        lines.append("inside: " + "; ".join(f"{n} {c / total:.1%}" for n, c in inside.most_common(top)))
        if natives:
            lines.append("inside, native: " + "; ".join(f"{n} {c / total:.1%}"
                                                        for n, c in inside_native.most_common(top)))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--native", action="store_true", help="also the compiled libraries' functions each thread was inside")
    args = p.parse_args()
    print("\n\n".join(summarize(f, args.top, args.native) for f in args.profiles))


if __name__ == "__main__":
    main()
