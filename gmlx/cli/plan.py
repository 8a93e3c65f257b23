"""``gmlx plan``: do WIDTH streams of DEPTH tokens each fit, and may they start now?

Without MODEL it asks a running server (``GET /v1/capacity/plan``, which also says
whether the fan-out may start now). With MODEL and no ``--url`` it loads the model
here and reads its capacity table against this machine's free memory. Exit code 0
when the streams fit, 1 when they do not or the server has no table to judge by.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console

from gmlx.cli.client import DEFAULT_URL, call_server
from gmlx.cli.estimate import OptionalModelArg, ServerUrlOpt, render_table
from gmlx.cli.local import load_here
from gmlx.cli.options import ApiKeyOpt, JsonOpt

EXIT_CODES = (
    "Exit codes: 0 the streams fit; 1 they do not fit, cannot be judged, or the plan failed "
    "(one sentence on stderr); 2 usage error."
)

WidthOpt = Annotated[int, typer.Option("--width", "-w", min=1, help="Streams that run together.")]
DepthOpt = Annotated[int, typer.Option("--depth", "-d", min=1, help="Tokens each stream reaches.")]


def plan_here(ref: str, width: int, depth: int) -> dict[str, Any]:
    """The plan for a model loaded here: its table at this machine's free memory."""
    from gmlx.engine.admission import offline_plan

    engine, worker, _ = load_here(ref)
    try:
        plan = offline_plan(engine.registry, width, depth, worker)
    finally:
        engine.registry.close()
    return {**plan.as_dict(), "where": "local"}


def plan_command(
    width: WidthOpt,
    depth: DepthOpt,
    model: OptionalModelArg = None,
    url: ServerUrlOpt = None,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check whether WIDTH streams of DEPTH tokens each fit a model's memory."""
    if url is None and model is not None:
        result = plan_here(model, width, depth)
        where = "here"
    else:
        url = url or DEFAULT_URL
        params: dict[str, Any] = {"width": width, "depth": depth}
        if model:
            params["model"] = model
        result = call_server("GET", url, "/v1/capacity/plan", api_key=api_key, params=params)
        where = url
    fits = result.get("ok") is True
    if as_json:
        typer.echo(json.dumps(result))
    else:
        out = Console()
        title = f"plan: {width} streams x {depth} tokens on {result.get('model')} ({where})"
        out.print(render_table(result, title))
        if fits:
            out.print("[bold green]fits[/]" + _admit_line(result) + ".")
        elif result.get("ok") is None:
            out.print(
                "[bold red]cannot be judged:[/] the server has no capacity table "
                "(none was built, or GMLX_OVERCOMMIT=1)."
            )
        else:
            out.print(f"[bold red]does not fit:[/] {result.get('detail')}.")
    raise typer.Exit(0 if fits else 1)


def _admit_line(result: dict[str, Any]) -> str:
    if result.get("admit_now") is None:
        return ""
    if result["admit_now"]:
        return ", and may start now"
    return f", but should wait: {result.get('detail')}"
