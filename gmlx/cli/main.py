"""The root ``gmlx`` Typer app: every command, built or planned."""

from __future__ import annotations

import typer

from gmlx import __version__
from gmlx.cli.cache import EXIT_CODES as CACHE_EXIT_CODES
from gmlx.cli.cache import cache_app
from gmlx.cli.errors import run_guarded
from gmlx.cli.estimate import EXIT_CODES as ESTIMATE_EXIT_CODES
from gmlx.cli.estimate import estimate_command
from gmlx.cli.launch import EXIT_CODES as LAUNCH_EXIT_CODES
from gmlx.cli.launch import launch_command
from gmlx.cli.plan import EXIT_CODES as PLAN_EXIT_CODES
from gmlx.cli.plan import plan_command
from gmlx.cli.residency import EXIT_CODES, keep_command, ps_command, unload_command
from gmlx.cli.run import EXIT_CODES as RUN_EXIT_CODES
from gmlx.cli.run import run_command
from gmlx.cli.serve import EXIT_CODES as SERVE_EXIT_CODES
from gmlx.cli.serve import serve_command
from gmlx.cli.top import EXIT_CODES as TOP_EXIT_CODES
from gmlx.cli.top import top_command

app = typer.Typer(
    name="gmlx",
    help="Serve local LLMs (GGUF and MLX model folders) on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    rich_markup_mode="rich",
)

# Every command's epilog states its exit codes ("Exit codes: 0 ...; 1 ..."); docs/cli.md lists them.
app.command(
    "run",
    help="Chat with a model in the terminal, or answer one prompt with -p.",
    epilog=RUN_EXIT_CODES,
)(run_command)
app.command(
    "serve",
    help="Serve models over the OpenAI and Anthropic HTTP protocols.",
    epilog=SERVE_EXIT_CODES,
)(serve_command)
app.command(
    "estimate",
    help="Estimate whether a prompt fits a model's memory and context.",
    epilog=ESTIMATE_EXIT_CODES,
)(estimate_command)
app.command(
    "plan",
    help="Check whether WIDTH streams of DEPTH tokens each fit a model.",
    epilog=PLAN_EXIT_CODES,
)(plan_command)
# short_help lists them; their docstrings are the full `--help`, the epilog the exit codes.
app.command("keep", short_help="Keep a model resident on a running server.", epilog=EXIT_CODES)(
    keep_command
)
app.command(
    "unload",
    short_help="Unload a model (or every idle model) from a running server.",
    epilog=EXIT_CODES,
)(unload_command)
app.command(
    "ps", short_help="List a running server's models and what they hold.", epilog=EXIT_CODES
)(ps_command)

app.command(
    "launch",
    short_help="Start a coding agent pointed at a gmlx server (starting one if needed).",
    epilog=LAUNCH_EXIT_CODES,
)(launch_command)

app.command(
    "top",
    short_help="Live dashboard of a running server: requests, queue, memory, rates.",
    epilog=TOP_EXIT_CODES,
)(top_command)
app.add_typer(
    cache_app,
    name="cache",
    short_help="List or clear the converted-weights cache of GGUF loads.",
    epilog=CACHE_EXIT_CODES,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gmlx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Serve local LLMs (GGUF and MLX model folders) on MLX."""


def main() -> None:
    run_guarded(lambda: app(prog_name="gmlx"))


if __name__ == "__main__":
    main()
