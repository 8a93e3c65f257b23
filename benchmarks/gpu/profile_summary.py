"""Where each thread's time went, from py-spy's speedscope profiles (bench.py --profile,
ttft_profile.py --profile): per thread its samples, the functions it was in last (self
time) and the functions of the servers' own code it was inside (inclusive time).

    python benchmarks/gpu/profile_summary.py PROFILE.json [PROFILE.json ...] [--top 12]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

OWN = ("gmlx/", "mlx_lm/", "uvicorn/", "starlette/", "fastapi/", "anyio/", "asyncio/")


def label(frame: dict) -> str:
    file = frame.get("file") or ""
    short = "/".join(file.split("/")[-2:]) if file else ""
    return f"{frame['name']} ({short}:{frame.get('line', '')})" if short else frame["name"]


def summarize(path: Path, top: int) -> str:
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
        for stack, w in zip(samples, weights, strict=True):
            if stack:
                leaf[label(frames[stack[-1]])] += w
            seen = {label(frames[i]) for i in stack if any(o in (frames[i].get("file") or "") for o in OWN)}
            for name in seen:
                inside[name] += w
        lines.append(f"\n### thread {prof['name']}: {total:.2f} {prof.get('unit', 'samples')}")
        lines.append("self: " + "; ".join(f"{n} {c / total:.1%}" for n, c in leaf.most_common(top)))
        lines.append("inside: " + "; ".join(f"{n} {c / total:.1%}" for n, c in inside.most_common(top)))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    print("\n\n".join(summarize(f, args.top) for f in args.profiles))


if __name__ == "__main__":
    main()
