"""``gmlx cache list`` and ``gmlx cache clear``: the converted-weights cache of GGUF loads.

Loading a GGUF converts its tensors to MLX's layout and builds its tokenizer once, and
keeps both under ``cache_dir()/converted`` (``gmlx.engine.loading.convert_cache``); these
commands show and delete those entries (SIZE counts both). (The server's ``/v1/cache/*`` routes are its prompt cache,
a different thing.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gmlx.cli.errors import fail
from gmlx.cli.options import JsonOpt

EXIT_CODES = "Exit codes: 0 done; 1 failed; 2 usage error."

cache_app = typer.Typer(
    help="The converted-weights cache that makes repeated GGUF loads fast.",
    no_args_is_help=True,
)


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= span:
            return f"{s / span:.0f} {unit} ago"
    return "just now"


@cache_app.command("list", epilog=EXIT_CODES)
def list_command(as_json: JsonOpt = False) -> None:
    """List the cached conversions: source GGUF, size and last use, most recent first."""
    from gmlx.engine.capacity import human
    from gmlx.engine.loading import convert_cache

    entries = convert_cache.entries()
    if as_json:
        rows = [
            {"source": e.source, "bytes": e.bytes, "last_used": e.last_used, "path": str(e.path)}
            for e in entries
        ]
        typer.echo(json.dumps({"entries": rows, "dir": str(convert_cache.cache_root())}))
        return
    out = Console(highlight=False)
    if not entries:
        out.print(f"no converted weights cached in {convert_cache.cache_root()}", markup=False)
        return
    table = Table(box=None, pad_edge=False)
    table.add_column("SOURCE", overflow="fold")
    table.add_column("SIZE", justify="right", no_wrap=True)
    table.add_column("LAST USED", justify="right", no_wrap=True)
    for e in entries:
        missing = "" if Path(e.source).exists() else " (gone)"
        table.add_row(e.source + missing, human(e.bytes), _ago(e.last_used))
    out.print(table)
    total = sum(e.bytes for e in entries)
    out.print(
        f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {human(total)} in "
        f"{convert_cache.cache_root()} (bound {human(convert_cache.max_bytes())}, "
        f"{convert_cache.ENV_MAX_BYTES})",
        markup=False,
    )


@cache_app.command("clear", epilog=EXIT_CODES)
def clear_command(
    source: Annotated[
        Path | None,
        typer.Argument(metavar="SOURCE", help="A GGUF file: remove its cached conversions."),
    ] = None,
    all_: Annotated[bool, typer.Option(
        "--all", help="Remove every cached conversion, and the compiled GPU kernels kept beside them.")] = False,
) -> None:
    """Remove the cached conversions of SOURCE, or all of them (and the compiled GPU
    kernels) with --all."""
    from gmlx.engine.capacity import human
    from gmlx.engine.loading import convert_cache

    if (source is None) == (not all_):
        fail("Give either a SOURCE GGUF file or --all.", code=2)
    removed = convert_cache.clear(None if all_ else source)
    if source is not None and not removed:
        fail(f"No cached conversion of {source}; `gmlx cache list` shows what is cached.")
    freed = sum(e.bytes for e in removed)
    noun = "entry" if len(removed) == 1 else "entries"
    Console(highlight=False).print(f"removed {len(removed)} {noun} ({human(freed)})", markup=False)
    if all_ and (kernels := convert_cache.clear_kernels()):
        Console(highlight=False).print(f"removed the compiled GPU kernels ({human(kernels)})", markup=False)
