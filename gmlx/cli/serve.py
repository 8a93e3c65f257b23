"""``gmlx serve``: the OpenAI and Anthropic HTTP protocols over the engine."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gmlx.cli.errors import err_console, fail

if TYPE_CHECKING:
    from gmlx.engine.loading.progress import LoadStatus

ModelsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Models to serve and load now: configured ids or aliases, `demo`, GGUF files, "
        "MLX folders. Configured models are served too, loading on first use.",
        show_default=False,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Config file (default: $GMLX_HOME/gmlx.yaml or ~/.config/gmlx/gmlx.yaml).",
        show_default=False,
    ),
]
HostOpt = Annotated[
    str | None,
    typer.Option("--host", help="Address to bind (default 127.0.0.1).", show_default=False),
]
PortOpt = Annotated[
    int | None,
    typer.Option(
        "--port", min=0, max=65535, help="Port to bind (default 8080).", show_default=False
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        help="Require this key (Bearer or x-api-key) on every route but /health.",
        show_default=False,
    ),
]

DecodeBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--decode-batch",
        min=1,
        max=512,
        help="Streams each model decodes together; also the queue cap's base "
        "(default: from each model's capacity table).",
        show_default=False,
    ),
]
ShutdownTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--shutdown-timeout",
        min=0,
        help="On SIGTERM or Ctrl-C, seconds the requests in flight get to finish; new ones "
        "get 503 meanwhile, and those still running are then cut with a typed error "
        "(default: the config's server.shutdown_timeout_s, 10).",
        show_default=False,
    ),
]


# 3 is uvicorn's own startup failure (it exits so when the address cannot be bound).
EXIT_CODES = (
    "Exit codes: 0 stopped (Ctrl-C or SIGTERM); 1 could not start (a bad config file, "
    "nothing to serve); 2 usage error; 3 could not listen (the port taken, an address "
    "not this machine's)."
)
SWITCH_INTERVAL_S = 0.0005
STARTUP_FAILURE = 3


def serve_command(
    models: ModelsArg = None,
    config: ConfigOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    api_key: ApiKeyOpt = None,
    decode_batch: DecodeBatchOpt = None,
    shutdown_timeout: ShutdownTimeoutOpt = None,
) -> None:
    """Serve until Ctrl-C; the named models load as the server starts.

    Flags win over ``GMLX_*`` environment variables, which win over the file.
    """
    from gmlx.compose import build_app, served_models
    from gmlx.config import load_settings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    # Each token crosses from a model's worker thread to the event loop; with Python's
    # default 5 ms switch interval a thread waiting for the GIL can wait that long, once
    # per token. A shorter interval keeps the hand-off well under a decode step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    settings = load_settings(config)
    flags = {"host": host, "port": port, "api_key": api_key, "decode_batch": decode_batch,
             "shutdown_timeout_s": shutdown_timeout}
    server = settings.server.model_copy(update={k: v for k, v in flags.items() if v is not None})
    settings, _ = settings.model_copy(update={"server": server}).with_models(models or [])
    if not served_models(settings):
        fail(
            f"Nothing to serve: name a model (for example `gmlx serve demo`) or list models in {settings.origin}."
        )
    # The port opens at once; the named, pinned and preload models load in the background
    # (`/health?ready=1` says `loading` meanwhile, and requests for them wait).
    from gmlx.engine.loading import progress
    from gmlx.server import shutdown

    with progress.listening(_print_progress):
        started = shutdown.serve(build_app(settings), server.host, server.port,
                                 settings.server.shutdown_timeout_s)
    if not started:  # as uvicorn's own runner: the address could not be bound
        raise typer.Exit(STARTUP_FAILURE)


def _print_progress(model_id: str, status: LoadStatus) -> None:
    """A model's load, as the server's console shows it: a line per phase, and a text
    bar every tenth of a phase that counts (a live bar would fight uvicorn's log)."""
    from gmlx.cli.local import PHASES

    words = PHASES.get(status.phase, status.phase)
    if not status.total:
        if status.done == 0:
            err_console.print(f"[dim]loading {model_id}: {words}[/]")
        return
    tenth = max(1, status.total // 10)
    if status.done % tenth and status.done != status.total:
        return
    filled = round(20 * status.done / status.total)
    err_console.print(f"[dim]loading {model_id}: {words} {'█' * filled}{'░' * (20 - filled)} "
                      f"{status.done}/{status.total}[/]", highlight=False)
