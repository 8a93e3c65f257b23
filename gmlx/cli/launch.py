"""``gmlx launch AGENT``: start a coding agent pointed at a gmlx server.

It reuses the gmlx server at ``--url``, or, when nothing listens there and the URL is
this machine's, starts ``gmlx serve`` in the background (its own session, a log and a
pid file in :func:`gmlx.paths.launch_dir`), left running for the next launch until
``gmlx launch --stop``. It keeps the model resident and warm (``POST /v1/keep``), reads
its window (``GET /v1/models``), writes the agent's config (:mod:`gmlx.cli.agents`) and
replaces itself with the agent. It imports no MLX: the server it starts does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit

import typer
from rich.markup import escape

from gmlx.cli.agents import AGENTS, Agent, Served, Setup, output_cap
from gmlx.cli.client import DEFAULT_URL, call_server
from gmlx.cli.errors import err_console, fail
from gmlx.cli.options import ApiKeyOpt, UrlOpt
from gmlx.paths import launch_dir
from gmlx.replies import keep_line, unreachable

EXIT_CODES = (
    "Exit codes: 0 --print-env or --stop done; once the agent starts, the agent's own; "
    "1 failed (no server, no agent, refused by the server); 2 usage error."
)
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
HEALTH_PROBE_S = 3.0
# The server listens before its models load, so this bounds Python and MLX starting up
# (and, the first time, building the demo model), not a model loading.
START_TIMEOUT_S = 120.0

AgentArg = Annotated[
    str | None,
    typer.Argument(
        metavar="AGENT",
        help=f"The coding agent: {', '.join(AGENTS)}.",
        show_default=False,
    ),
]
AgentArgsArg = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="AGENT_ARGS",
        help="Arguments passed to the agent as they are, after `--`.",
        show_default=False,
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="A configured id or alias, `demo`, a GGUF file or an MLX folder "
        "(default: the server's default model).",
        show_default=False,
    ),
]
PrintEnvOpt = Annotated[
    bool,
    typer.Option(
        "--print-env",
        help="Print, as a shell script, the variables it would set and the files it would "
        "write, and exit; asks a running server for the model's window, starts nothing.",
    ),
]
StopOpt = Annotated[
    bool, typer.Option("--stop", help="Stop the server an earlier `gmlx launch` started.")
]


def _fail(sentence: str) -> NoReturn:
    fail(escape(sentence))  # paths and a server's words may hold [brackets] that are not markup


def find_agent(name: str) -> Agent:
    agent = AGENTS.get(name.lower())
    if agent is None:
        raise typer.BadParameter(
            f"{name!r} is not an agent gmlx launches; known agents: {', '.join(AGENTS)}.",
            param_hint="AGENT",
        )
    return agent


# -- the server ------------------------------------------------------------------------


def pid_file(port: int) -> Path:
    return launch_dir() / f"server-{port}.pid"


def probe(url: str) -> bool:
    """True when a gmlx server answers ``GET /health`` at ``url``, False when nothing
    listens there; anything else answering ends the command with one sentence."""
    import httpx

    try:
        r = httpx.get(url + "/health", timeout=HEALTH_PROBE_S)
    except httpx.ConnectError:
        return False
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        _fail(unreachable(url, e))
    try:
        body = r.json()
    except ValueError:
        body = None
    # gmlx answers exactly {"status": "healthy", "pid": N}; other servers' /health differ.
    if not (
        isinstance(body, dict)
        and body.get("status") == "healthy"
        and isinstance(body.get("pid"), int)
    ):
        _fail(
            f"Something answers at {url}, but not as a gmlx server (GET /health: "
            f"{r.status_code}); stop it or pick another --url."
        )
    return True


def start_server(url: str, model: str | None, api_key: str | None) -> tuple[subprocess.Popen, Path]:
    """Start ``gmlx serve [MODEL]`` on ``url``'s host and port, detached from this
    terminal (its own session, no stdin) so it outlives the agent; returns it and its log."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOCAL_HOSTS:
        _fail(
            f"No gmlx server answers at {url}, and gmlx launch starts one only at an "
            "http:// address on this machine (127.0.0.1, localhost); start it there."
        )
    port = parts.port or 80
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
    folder = launch_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"server-{port}.log"
    command = [sys.executable, "-m", "gmlx.cli.main", "serve", *([model] if model else [])]
    command += ["--host", str(host), "--port", str(port)]
    # The key goes through the environment (GMLX_API_KEY), not argv, which `ps` shows.
    env = {**os.environ, **({"GMLX_API_KEY": api_key} if api_key else {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    pid_file(port).write_text(f"{proc.pid}\n")
    return proc, log


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Wait until the started server answers ``/health``, or fail saying why with its log."""
    deadline = time.monotonic() + timeout
    while not probe(url):
        if (code := proc.poll()) is not None:
            said = last_line(log)
            _fail(
                f"The gmlx server exited with code {code} before it answered"
                + (f" ({said.removeprefix('error: ').rstrip('.')})" if said else "")
                + f"; its log is {log}."
            )
        if time.monotonic() > deadline:
            _fail(
                f"The gmlx server did not answer at {url} within {timeout:g} s; it may "
                f"still be starting (log: {log}), and `gmlx launch --stop` ends it."
            )
        time.sleep(0.25)


def stop_servers() -> None:
    """End every server an earlier launch started (its pid file names it), or say none runs."""
    import psutil

    stopped = False
    for path in sorted(launch_dir().glob("server-*.pid")):
        port = path.stem.removeprefix("server-")
        try:
            proc = psutil.Process(int(path.read_text().strip()))
            # A pid is reused once its process ends: end it only if it is still our server.
            ours = "gmlx.cli.main" in proc.cmdline() and "serve" in proc.cmdline()
        except (ValueError, psutil.Error):
            ours = False
        if ours:
            proc.terminate()  # uvicorn shuts down cleanly on SIGTERM
            try:
                proc.wait(timeout=15)
            except psutil.TimeoutExpired:
                proc.kill()
            typer.echo(f"stopped the gmlx server on port {port} (pid {proc.pid})")
            stopped = True
        path.unlink(missing_ok=True)
    if not stopped:
        typer.echo("no gmlx server started by `gmlx launch` is running")


# -- the model -------------------------------------------------------------------------


def agent_model(model: str | None) -> str | None:
    """What the agent asks for: for a model path, the id `gmlx serve PATH` serves it
    under; else the model as given (None: the server's default)."""
    if model is None or not Path(model).expanduser().exists():
        return model
    from gmlx.config import load_settings

    return load_settings().with_models([model])[1][0]


def model_row(rows: list[dict[str, Any]], model: str | None, url: str) -> dict[str, Any]:
    """The listing's row for ``model`` (an id or alias, maybe with ``@profile``), or the
    default model's row when ``model`` is None."""
    if model is None:
        ids = [r for r in rows if not r.get("alias_of")]
        defaults = [r for r in ids if r.get("default")] or (ids if len(ids) == 1 else [])
        if not defaults:
            names = ", ".join(str(r.get("id")) for r in ids) or "none"
            _fail(f"The server at {url} has no default model; name one with --model ({names}).")
        return defaults[0]
    for name in (model, model.rpartition("@")[0]):
        for row in rows:
            if row.get("id") == name:
                return row
    names = ", ".join(str(r.get("id")) for r in rows) or "none"
    _fail(f"The server at {url} does not serve {model!r} (served: {names}).")


def window_of(row: dict[str, Any], url: str) -> int:
    """The model's usable window: its memory-bound window at width 1 where the server
    computed one (never above the trained window), else its context length."""
    known = [
        v
        for v in (row.get("max_context_at_width_1"), row.get("context_length"))
        if isinstance(v, int) and v > 0
    ]
    if not known:
        model = row.get("id")
        _fail(f"The server at {url} does not know {model}'s window yet; run `gmlx keep {model}`.")
    return min(known)


def listing(url: str, api_key: str | None) -> list[dict[str, Any]]:
    rows = call_server("GET", url, "/v1/models", api_key=api_key).get("data") or []
    owners = ", ".join(sorted({str(r.get("owned_by")) for r in rows} - {"gmlx"}))
    if owners:  # an OpenAI-compatible server whose /health looks like gmlx's
        _fail(f"The server at {url} is not a gmlx server (its models are owned by {owners}).")
    return rows


def serve_model(url: str, model: str | None, api_key: str | None, *, prepare: bool) -> Served:
    """The model the agent will use at ``url``. With ``prepare``: start a server when
    none answers, keep the model resident and warm; without, only ask a running one."""
    name = agent_model(model)
    if not probe(url):
        if not prepare:
            _fail(
                f"No gmlx server answers at {url}, and --print-env starts none: start "
                "one (`gmlx serve`), or run `gmlx launch` without --print-env."
            )
        proc, log = start_server(url, model, api_key)
        err_console.print(escape(f"started a gmlx server at {url} (log: {log})"), soft_wrap=True)
        with err_console.status(escape(f"waiting for the gmlx server at {url}")):
            wait_healthy(url, proc, log, START_TIMEOUT_S)
    rows = listing(url, api_key)
    if prepare:
        body = {"model": name or "", "keep": True, "warm": True}
        with err_console.status(escape(f"loading and warming {name or 'the default model'}")):
            kept = call_server("POST", url, "/v1/keep", api_key=api_key, json=body, timeout=None)
        err_console.print(escape(keep_line(kept)), soft_wrap=True)
        name = name or str(kept.get("model"))
        rows = listing(url, api_key)  # the window of a model loaded just now is its own
    row = model_row(rows, name, url)
    window = window_of(row, url)
    return Served(url, name or str(row["id"]), window, output_cap(window), api_key)


# -- the agent -------------------------------------------------------------------------


def shell_script(agent: Agent, served: Served, setup: Setup, args: list[str]) -> str:
    """What launch sets and writes, as a script a POSIX shell can source."""
    lines = [
        f"# gmlx launch {agent.name}: {served.model} at {served.url}, window "
        + f"{served.window} tokens, output cap {served.cap}"
    ]
    lines += [f"unset {name}" for name in setup.unset]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in setup.env.items()]
    for path, text in setup.files.items():
        lines += [
            f"mkdir -p {shlex.quote(str(path.parent))}",
            f"cat > {shlex.quote(str(path))} <<'GMLX_EOF'",
            text.rstrip("\n"),
            "GMLX_EOF",
        ]
    lines.append(f"# then run: {shlex.join([agent.binary, *setup.args, *args])}")
    return "\n".join(lines)


def exec_agent(binary: str, setup: Setup, args: list[str]) -> None:
    """Write the agent's files and become the agent (this process ends here)."""
    for path, text in setup.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in setup.unset} | setup.env
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(binary, [Path(binary).name, *setup.args, *args], env)


def launch_command(
    agent: AgentArg = None,
    agent_args: AgentArgsArg = None,
    model: ModelOpt = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: ApiKeyOpt = None,
    print_env: PrintEnvOpt = False,
    stop: StopOpt = False,
) -> None:
    """Start a coding agent (claude, codex, pi, opencode) pointed at a gmlx server: the
    one at --url, or, when none answers there and the URL is this machine's, a `gmlx
    serve [MODEL]` it starts in the background and leaves running for the next launch
    (`gmlx launch --stop` ends it). It keeps the model resident and warm, gives the agent
    the model's window and an output cap, then runs it with AGENT_ARGS (after `--`)."""
    if stop:
        if agent or agent_args or print_env:
            raise typer.BadParameter("--stop takes no AGENT, arguments or --print-env.")
        stop_servers()
        return
    if agent is None:
        raise typer.BadParameter(
            "name the agent to launch: " + ", ".join(AGENTS) + ".", param_hint="AGENT"
        )
    chosen = find_agent(agent)
    binary = shutil.which(chosen.binary)
    if binary is None and not print_env:  # say so before starting a server for nothing
        _fail(
            f"`{chosen.binary}` is not on PATH: install it with `npm install -g {chosen.package}`."
        )
    served = serve_model(url.rstrip("/"), model, api_key, prepare=not print_env)
    setup = chosen.configure(served, launch_dir() / chosen.name)
    args = list(agent_args or [])
    if print_env or binary is None:
        typer.echo(shell_script(chosen, served, setup, args))
        return
    exec_agent(binary, setup, args)
