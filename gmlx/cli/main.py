"""The root ``gmlx`` Typer app: every command, built or planned."""

from __future__ import annotations

import typer

from gmlx import __version__
from gmlx.cli.errors import err_console, run_guarded
from gmlx.cli.estimate import estimate_command
from gmlx.cli.launch import EXIT_CODES as LAUNCH_EXIT_CODES
from gmlx.cli.launch import launch_command
from gmlx.cli.plan import plan_command
from gmlx.cli.residency import EXIT_CODES, keep_command, ps_command, unload_command
from gmlx.cli.run import run_command
from gmlx.cli.serve import serve_command

app = typer.Typer(
    name="gmlx",
    help="Serve local LLMs (GGUF and MLX model folders) on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    rich_markup_mode="rich",
)

app.command("run", help="Chat with a model in the terminal, or answer one prompt with -p.")(run_command)
app.command("serve", help="Serve models over the OpenAI and Anthropic HTTP protocols.")(serve_command)
app.command("estimate", help="Estimate whether a prompt fits a model's memory and context.")(
    estimate_command
)
app.command("plan", help="Check whether WIDTH streams of DEPTH tokens each fit a model.")(plan_command)
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

# Commands announced in the CLI before they exist: each says so and exits 2.
PLANNED = {
    "top": "Live dashboard of a running server: requests, queue, memory, rates.",
}


def _planned(name: str, help_text: str) -> None:
    @app.command(
        name,
        help=f"{help_text} (not built yet)",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def _cmd(ctx: typer.Context) -> None:
        err_console.print(f"[bold red]error:[/] `gmlx {name}` is not built yet.")
        raise typer.Exit(2)


for _name, _help in PLANNED.items():
    _planned(_name, _help)


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
