"""``gmlx top``: the live dashboard of a running server, or one snapshot with --once.

Textual (and the dashboard) are imported only when the command runs, so
``gmlx --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated

import typer

from gmlx.cli.client import DEFAULT_URL
from gmlx.cli.options import ApiKeyOpt, UrlOpt

if TYPE_CHECKING:
    from gmlx.tui.source import HttpSource, Poll

EXIT_CODES = (
    "Exit codes: 0 done (the dashboard quit, or --once printed); 1 --once could not reach "
    "the server, or it refused (one sentence on stderr); 2 usage error."
)


def top_command(
    url: UrlOpt = DEFAULT_URL,
    api_key: ApiKeyOpt = None,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.1, help="Seconds between two polls of the server."),
    ] = 1.0,
    once: Annotated[
        bool,
        typer.Option("--once", help="Print one snapshot (header, models, requests) and exit."),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="With --once: print the raw /v1/metrics JSON instead."),
    ] = False,
) -> None:
    """Watch a running server live: the governor band, memory, queue, each resident
    model, every request in flight, and decode/prefill rates. Keys: c cancels the
    selected request, u unloads and k keeps the selected model, / filters requests
    by model, s sorts, ? lists the keys, q quits. It keeps polling while the server
    is away and reconnects when it is back."""
    from gmlx.tui.source import HttpSource

    if as_json and not once:
        raise typer.BadParameter("--json prints one snapshot; it goes with --once.")
    source = HttpSource(url, api_key, timeout=max(2.0, min(10.0, interval * 5)))
    if once:
        _once(source, as_json)
        return
    from gmlx.tui.app import build_app

    build_app(source, interval=interval).run()


def _once(source: HttpSource, as_json: bool) -> None:
    """Print one poll, or end with its one sentence and exit code 1."""
    from rich.console import Console
    from rich.markup import escape

    from gmlx.cli.errors import fail
    from gmlx.tui.once import render

    async def poll_and_close() -> Poll:
        try:
            return await source.poll()
        finally:
            await source.close()

    poll = asyncio.run(poll_and_close())
    if poll.error is not None:
        fail(escape(poll.error.sentence))
    if as_json:
        typer.echo(json.dumps(poll.metrics))
        return
    Console(highlight=False).print(render(poll, source.url))
