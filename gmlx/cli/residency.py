"""``gmlx keep``, ``gmlx unload`` and ``gmlx ps``: which models a running server holds.

A server loads a configured model on its first request and unloads it after an idle
timeout. ``keep`` holds a model past that timeout (loading and warming it now),
``unload`` frees one model, or every idle one, at once, and ``ps`` lists the models
with what each holds and runs. All three only talk HTTP (``POST /v1/keep``,
``POST /unload``, ``GET /v1/models``); nothing here imports MLX.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from gmlx.cli.client import DEFAULT_URL, call_server
from gmlx.cli.errors import fail
from gmlx.cli.options import ApiKeyOpt, JsonOpt, UrlOpt
from gmlx.replies import keep_line, unload_line

EXIT_CODES = "Exit codes: 0 done; 1 failed or refused by the server; 2 usage error."

ServedModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL", help="A model id or alias the server serves.", show_default=False
    ),
]


def _say(line: str, as_json: bool, body: dict[str, Any]) -> None:
    if as_json:
        typer.echo(json.dumps(body))
    else:
        Console(highlight=False).print(line, markup=False)


# -- keep -------------------------------------------------------------------------------


def keep_command(
    model: ServedModelArg,
    no_warm: Annotated[
        bool, typer.Option("--no-warm", help="Load it without running its decode widths once.")
    ] = False,
    release: Annotated[
        bool,
        typer.Option("--release", help="Stop keeping it: it unloads after its idle timeout again."),
    ] = False,
    url: UrlOpt = DEFAULT_URL,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Keep MODEL resident on a running server past its idle timeout: load it now if
    it is not, and warm it (compile its kernels) unless --no-warm. --release lets it
    go again."""
    if no_warm and release:
        raise typer.BadParameter("--no-warm keeps a model; it cannot go with --release.")
    body = {"model": model, "keep": not release, "warm": not (release or no_warm)}
    # Loading and warming a large model takes minutes: wait as long as it takes.
    answer = call_server("POST", url, "/v1/keep", api_key=api_key, json=body, timeout=None)
    if not release and not answer.get("kept"):
        # The server loaded it, but an unload or a config reload took it meanwhile.
        fail(
            escape(
                f"{model} was unloaded while it loaded, so it is not kept; run `gmlx keep` again."
            )
        )
    _say(keep_line(answer), as_json, answer)


# -- unload -----------------------------------------------------------------------------


def unload_command(
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help="A model id or alias; without it, every idle model unloads.",
            show_default=False,
        ),
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Unload MODEL from a running server, or every idle model without one. A model
    that is streaming is refused (exit code 1): retry when it finishes."""
    body = {"model": model} if model is not None else {}
    answer = call_server("POST", url, "/unload", api_key=api_key, json=body)
    _say(unload_line(answer, model), as_json, answer)


# -- ps ---------------------------------------------------------------------------------


def human_bytes(n: int | None) -> str:
    from gmlx.engine.capacity import human  # pure; imports no MLX

    return "—" if n is None else human(n)


def human_idle(seconds: float | None) -> str:
    """``—`` when it is not resident or running now, else seconds, minutes or hours."""
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _flag(value: Any) -> str:
    return {True: "yes", False: "", None: "—"}.get(value, str(value))


def _count(value: int | None) -> str:
    return "—" if value is None else str(value)


def _name(row: dict[str, Any]) -> str:
    name = str(row.get("id"))
    if row.get("alias_of"):
        return f"{name} → {row['alias_of']}"
    return f"{name} (default)" if row.get("default") else name


def models_table(rows: list[dict[str, Any]]) -> Table:
    """The models as a table: one row per model id, then one per alias."""
    # No rules, as `docker ps`: nine columns then fit an 80-column pipe untruncated.
    table = Table(box=None, pad_edge=False)
    columns: list[tuple[str, JustifyMethod]] = [
        ("model", "left"),
        ("resident", "center"),
        ("pinned", "center"),
        ("kept", "center"),
        ("running", "right"),
        ("waiting", "right"),
        ("weights", "right"),
        ("idle", "right"),
        ("context", "right"),
    ]
    for header, justify in columns:
        table.add_column(header, justify=justify)
    for row in rows:
        context = row.get("context_length")
        table.add_row(
            _name(row),
            _flag(row.get("resident")),
            _flag(row.get("pinned")),
            _flag(row.get("kept")),
            _count(row.get("in_flight")),
            _count(row.get("waiting")),
            human_bytes(row.get("weight_bytes")),
            human_idle(row.get("idle_s")),
            "—" if context is None else str(context),
            style="dim" if row.get("alias_of") or not row.get("resident") else None,
        )
    return table


def summary(rows: list[dict[str, Any]]) -> str:
    """``1 of 2 models resident (12.3 MiB of weights)``: model ids only, not aliases."""
    models = [r for r in rows if not r.get("alias_of")]
    resident = [r for r in models if r.get("resident")]
    weights = sum(r.get("weight_bytes") or 0 for r in resident)
    held = f" ({human_bytes(weights)} of weights)" if weights else ""
    return f"{len(resident)} of {len(models)} models resident{held}"


def ps_command(
    resident_only: Annotated[
        bool, typer.Option("--resident", help="List only the models loaded now.")
    ] = False,
    url: UrlOpt = DEFAULT_URL,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the models a running server serves: every configured model and alias,
    whether it is loaded (resident), pinned by the config or kept by `gmlx keep`,
    its requests running and waiting, its weights, how long it has been idle, and its
    context window. --resident lists only the loaded ones."""
    answer = call_server("GET", url, "/v1/models", api_key=api_key)
    rows = [r for r in answer.get("data", []) if r.get("resident") or not resident_only]
    if as_json:
        typer.echo(json.dumps({**answer, "data": rows}))
        return
    out = Console(highlight=False)
    if rows:
        out.print(models_table(rows))
    out.print(summary(answer.get("data", [])), markup=False)
