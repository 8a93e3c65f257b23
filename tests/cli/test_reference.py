"""docs/cli.md is current, every command states its exit codes, and the CLI writes no
colour codes where its output is not a terminal (or ``NO_COLOR`` is set)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated

import pytest
import typer

from gmlx.cli.main import app
from gmlx.cli.reference import REFERENCE_PATH, REGENERATE, exit_codes, render, walk

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens there
SGR = re.compile(r"\x1b\[([0-9;]*)m")
# Variables that force colour on whatever the stream is; the tests run as a user's pipe does.
FORCING = (
    "FORCE_COLOR",
    "PY_COLORS",
    "GITHUB_ACTIONS",
    "TTY_COMPATIBLE",
    "TTY_INTERACTIVE",
    "NO_COLOR",
)


# -- the reference ------------------------------------------------------------------------


def test_shipped_reference_is_current():
    shipped = REFERENCE_PATH.read_text() if REFERENCE_PATH.is_file() else ""
    assert shipped == render(), f"docs/cli.md is stale: run `{REGENERATE}`"


def test_every_command_states_0_1_and_2_as_exit_codes():
    root = typer.main.get_command(app)
    for command, ctx in list(walk(root, typer.Context(root, info_name="gmlx")))[1:]:
        if "not built yet" in (command.help or ""):
            continue  # a placeholder, which exits 2 and says so
        codes = exit_codes(command.epilog)
        assert codes, (
            f"`{ctx.command_path}` states no exit codes: give it an epilog 'Exit codes: 0 ...; 1 ...; 2 ...'"
        )
        assert {"0", "1", "2"} <= {n for n, _ in codes}, (ctx.command_path, codes)


def test_run_names_ctrl_c_and_launch_the_agents_code():
    doc = REFERENCE_PATH.read_text()
    run_section = doc.split("## `gmlx run`")[1].split("\n## ")[0]
    launch_section = doc.split("## `gmlx launch`")[1].split("\n## ")[0]
    assert "- `130`: stopped with Ctrl-C" in run_section
    assert "the agent's own" in launch_section


def _toy_app() -> typer.Typer:
    toy = typer.Typer(name="toy", help="A toy [bold]app[/].", rich_markup_mode="rich")

    @toy.command("go", epilog="Exit codes: 0 went, fast; 1 failed; 2 usage error; 3 other.")
    def go(
        where: Annotated[str, typer.Argument(help="Where | to go.")],
        times: Annotated[int, typer.Option("--times", "-n", min=1, max=9, help="How often.")] = 2,
        loud: Annotated[bool, typer.Option("--loud", help="Shout.")] = False,
        think: Annotated[bool | None, typer.Option("--think/--no-think")] = None,
        url: Annotated[
            str,
            typer.Option("--url", envvar="TOY_URL", show_default=False, help="Base (default x)."),
        ] = "x",
    ) -> None:
        """Go somewhere.

        Twice, by
        default."""

    sub = typer.Typer(help="Things to fetch.")

    @sub.command("fetch", epilog="Exit codes: any.")
    def fetch(items: Annotated[list[str] | None, typer.Argument(help="Items.")] = None) -> None:
        """Fetch ITEMS."""

    toy.add_typer(sub, name="things")
    return toy


def test_render_walks_groups_and_reads_types_defaults_ranges_and_exit_codes(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = render(_toy_app())
    monkeypatch.setenv("COLUMNS", "300")
    assert render(_toy_app()) == narrow, "the reference depends on the terminal width"
    assert "\x1b[" not in narrow
    assert "A toy app." in narrow  # markup rendered as --help renders it
    assert "```text\ntoy go [OPTIONS] WHERE\n```" in narrow
    assert "Go somewhere.\n\nTwice, by default." in narrow
    assert "| `WHERE` | `str` | required | Where \\| to go. |" in narrow
    assert "| `--times`, `-n` | `int` 1 to 9 | `2` | How often. |" in narrow
    assert "| `--loud` | `flag` | off | Shout. |" in narrow
    assert "| `--think`, `--no-think` | `flag` | — |  |" in narrow
    assert "| `--url` | `str` | — | Base (default x). Env: `TOY_URL`. |" in narrow
    assert "- `0`: went, fast\n- `1`: failed\n- `2`: usage error\n- `3`: other" in narrow
    # A subcommand group and its commands, listed and linked.
    assert "## `toy things`" in narrow and "## `toy things fetch`" in narrow
    assert "- [`toy things fetch`](#toy-things-fetch): Fetch ITEMS." in narrow
    assert "toy things fetch [OPTIONS] [ITEMS]..." in narrow
    assert "### Exit codes\n\n- any.\n" in narrow  # outside the convention: kept whole


def test_exit_codes_may_be_separated_by_commas_when_no_item_needs_one():
    assert exit_codes("Exit codes: 0 done, 1 failed, 2 usage error.") == [
        ("0", "done"),
        ("1", "failed"),
        ("2", "usage error"),
    ]
    assert exit_codes("Exit codes: 0 done; 1 failed (a, 2 b); 2 usage error.") == [
        ("0", "done"),
        ("1", "failed (a, 2 b)"),
        ("2", "usage error"),
    ]
    assert exit_codes("No codes here.") is None


# -- colour -------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FORCING}
    return {**env, **extra}


def _gmlx(*args: str) -> subprocess.CompletedProcess[bytes]:
    """``gmlx ARGS`` with stdout and stderr piped, as a script runs it."""
    return subprocess.run(
        [sys.executable, "-m", "gmlx.cli.main", *args],
        env=_env(),
        capture_output=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def models_server() -> Iterator[str]:
    """A stand-in server that answers ``GET /v1/models`` with one resident model and
    one alias: enough for ``gmlx ps`` to print its styled table."""
    rows = [
        {
            "id": "a",
            "object": "model",
            "owned_by": "gmlx",
            "resident": True,
            "default": True,
            "pinned": True,
            "kept": False,
            "in_flight": 1,
            "waiting": 0,
            "weight_bytes": 1 << 20,
            "idle_s": None,
            "context_length": 4096,
        },
        {"id": "b", "object": "model", "owned_by": "gmlx", "alias_of": "a", "resident": True},
    ]

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            body = json.dumps({"object": "list", "data": rows}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("args", "code", "stream", "words"),
    [
        (["ps", "--url", DOWN], 1, "stderr", b"error: Cannot reach"),  # err_console
        (["keep"], 2, "stderr", b"Missing argument"),  # Typer's usage panel
        (["keep", "--help"], 0, "stdout", b"Exit codes: 0 done"),  # Typer's help
        (["ps", "--url", "{server}"], 0, "stdout", b"1 of 1 models resident"),  # a Console table
    ],
)
def test_piped_output_has_no_escape_codes(models_server, args, code, stream, words):
    r = _gmlx(*[a.replace("{server}", models_server) for a in args])
    assert r.returncode == code, r.stderr
    assert words in getattr(r, stream)
    assert b"\x1b[" not in r.stdout and b"\x1b[" not in r.stderr


def _colours(data: bytes) -> list[str]:
    """The SGR sequences in ``data`` that set a foreground or background colour."""
    found = []
    for params in SGR.findall(data.decode(errors="replace")):
        numbers = [int(p) for p in params.split(";") if p.isdigit()]
        if any(30 <= n <= 49 or 90 <= n <= 107 for n in numbers):
            found.append(params)
    return found


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_terminal_gets_colour_unless_no_color_is_set():
    import pty

    def on_a_terminal(**env: str) -> bytes:
        leader, follower = pty.openpty()
        try:
            subprocess.run(
                [sys.executable, "-m", "gmlx.cli.main", "ps", "--url", DOWN],
                stdin=subprocess.DEVNULL,
                stdout=follower,
                stderr=follower,
                env=_env(TERM="xterm-256color", **env),
                timeout=120,
                check=False,
            )
        finally:
            os.close(follower)
        try:
            return os.read(leader, 1 << 16)
        finally:
            os.close(leader)

    assert _colours(on_a_terminal()), "a terminal should see the red error"
    quiet = on_a_terminal(NO_COLOR="1")
    assert b"error:" in quiet and not _colours(quiet)
