"""The load-time tuner's decisions carried from one lease to the next: a first load of
the 8B on a fresh machine times every product's launch shapes (~440 s of a ~30-minute
lease on an H100, 12-07), a load with them kept ~80 s. ``keep`` copies a lease's
``tuning.json`` out (into ``$OUT``, named by its card); kept here under
``benchmarks/gpu/kernels/tunings/``, the next lease's ``take`` puts the one made on the
same card, MLX and format (``gmlx.engine.kernels.tuning.machine``) where gmlx's load
reads it, unless that machine has one already. A tuning of another card is left alone:
an H100's and an H200's choices differ.

    python benchmarks/gpu/tunings.py keep /tmp/gmlx-home $OUT
    python benchmarks/gpu/tunings.py take /tmp/gmlx-home [benchmarks/gpu/kernels/tunings]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KEPT = Path(__file__).resolve().parent / "kernels" / "tunings"


def _file(home: Path) -> Path:
    from gmlx.engine.kernels.tuning import file_in

    return file_in(home / "cache")  # (GMLX_HOME's cache folder: gmlx.paths.cache_dir)


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def slug(machine: str) -> str:
    """A file name for a machine's tuning: its MLX, architecture and card."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", machine).strip("-") + ".json"


def keep(home: Path, out: Path) -> str:
    """``home``'s tuning copied into ``out``, named by its machine."""
    data = _read(_file(home))
    if data is None or not data.get("entries"):
        return f"no tuning in {home} to keep"
    out.mkdir(parents=True, exist_ok=True)
    target = out / slug(str(data.get("machine")))
    shutil.copyfile(_file(home), target)
    return f"kept the tuning of {data.get('machine')} ({len(data['entries'])} entries) as {target}"


def take(home: Path, kept: Path = KEPT) -> str:
    """The kept tuning made on this machine put where ``home``'s loads read it, unless
    ``home`` has a tuning of this machine already."""
    from gmlx.engine.kernels.tuning import FORMAT, machine, made_for

    here = machine()
    if made_for(_read(_file(home)), here):
        return f"{home} has a tuning of {here} already"
    for path in sorted(kept.glob("*.json")):
        data = _read(path)
        if made_for(data, here):
            _file(home).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, _file(home))
            return f"took the tuning of {here} ({len(data.get('entries', {}))} entries) from {path.name}"
    return f"no kept tuning of {here} (format {FORMAT}): the first load tunes"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("keep", "take"))
    p.add_argument("home", type=Path, help="the GMLX_HOME the loads use")
    p.add_argument("where", type=Path, nargs="?", help="keep: the folder to copy into; take: the kept tunings")
    args = p.parse_args()
    if args.action == "keep":
        if args.where is None:
            p.error("keep needs the folder to copy into")
        print(keep(args.home, args.where))
    else:
        print(take(args.home, args.where or KEPT))


if __name__ == "__main__":
    main()
