"""The CLI in-process (Typer's CliRunner), for the CLI tests of any folder."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from gmlx.cli.main import app

runner = CliRunner()


def gmlx(*args: str, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, list(args), env=env)


def one_error_line(r: Result) -> str:
    """The failure's sentence, after checking it is one line on stderr with exit code 1."""
    assert r.exit_code == 1, r.output
    assert r.stdout == "" and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    return r.stderr
