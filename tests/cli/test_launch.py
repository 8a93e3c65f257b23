"""`gmlx launch`: its usage errors, what `--print-env` prints for each agent against a
live server, the agent it becomes (a fake on PATH that records what it was given), and
a server it starts in the background, reuses, and stops."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cli_runner import gmlx, one_error_line
from live_server import LiveServer, free_port, serve_config

from gmlx.cli.agents import AGENTS, output_cap
from gmlx.paths import launch_dir

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens there




def parse_script(text: str) -> tuple[dict[str, str], dict[str, str], list[str], list[str]]:
    """A `--print-env` script's exports, files (path: content), unsets and command."""
    env: dict[str, str] = {}
    files: dict[str, str] = {}
    unset: list[str] = []
    run: list[str] = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = shlex.split(value)[0]
        elif line.startswith("unset "):
            unset.append(line.removeprefix("unset "))
        elif line.startswith("cat > "):
            path = shlex.split(line.removeprefix("cat > ").removesuffix(" <<'GMLX_EOF'"))[0]
            body = []
            for body_line in lines:
                if body_line == "GMLX_EOF":
                    break
                body.append(body_line)
            files[path] = "\n".join(body) + "\n"
        elif line.startswith("# then run: "):
            run = shlex.split(line.removeprefix("# then run: "))
    return env, files, unset, run


# -- without a server ------------------------------------------------------------------


def test_help_names_the_agents_flags_and_exit_codes():
    r = gmlx("launch", "--help")
    assert r.exit_code == 0
    for word in (*AGENTS, "--model", "--url", "--api-key", "--print-env", "--stop", "GMLX_URL"):
        assert word in r.stdout
    assert "Exit codes: 0 --print-env or --stop done" in " ".join(r.stdout.split())
    root = gmlx("--help")
    (line,) = [ln for ln in root.stdout.splitlines() if ln.startswith("│ launch ")]
    assert "not built yet" not in line


def test_an_unknown_agent_lists_the_known_ones():
    r = gmlx("launch", "aider")
    assert r.exit_code == 2
    said = " ".join(r.stderr.replace("│", " ").split())
    assert (
        "'aider' is not an agent gmlx launches; known agents: claude, codex, pi, opencode." in said
    )


@pytest.mark.parametrize(
    "args", [["launch"], ["launch", "--stop", "codex"], ["launch", "--stop", "--print-env"]]
)
def test_usage_errors_exit_2(args):
    assert gmlx(*args).exit_code == 2


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_a_missing_agent_names_its_npm_package(name, tmp_path):
    line = one_error_line(gmlx("launch", name.upper(), "--url", DOWN, env={"PATH": str(tmp_path)}))
    agent = AGENTS[name]
    assert (
        f"`{agent.binary}` is not on PATH: install it with `npm install -g {agent.package}`" in line
    )


def test_print_env_starts_no_server():
    line = one_error_line(gmlx("launch", "codex", "--url", DOWN, "--print-env"))
    assert f"No gmlx server answers at {DOWN}, and --print-env starts none" in line


def test_stop_without_a_server_says_so():
    r = gmlx("launch", "--stop")
    assert r.exit_code == 0, r.output
    assert r.stdout == "no gmlx server started by `gmlx launch` is running\n"


def test_output_cap_is_a_share_of_the_window():
    assert [output_cap(w) for w in (100, 8192, 32768, 262144)] == [25, 2048, 8192, 8192]


# -- against a live server -------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveServer]:
    """A live server with the demo model loaded, not kept."""
    server = serve_config(
        tmp_path_factory.mktemp("launch"), "server: {decode_batch: 2, warmup: false}\n"
    )
    yield server
    server.stop()


def demo_row(url: str) -> dict:
    rows = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return next(row for row in rows if row["id"] == "demo")


@pytest.fixture(scope="module")
def window(live: LiveServer) -> int:
    row = demo_row(live.url)
    return min(v for v in (row["max_context_at_width_1"], row["context_length"]) if v)


def print_env(live: LiveServer, agent: str, *more: str) -> tuple[dict, dict, list, list]:
    r = gmlx("launch", agent, "--url", live.url, "--print-env", *more, "--", "--foo")
    assert r.exit_code == 0, r.output
    return parse_script(r.stdout)


def test_print_env_claude(live, window):
    env, files, unset, run = print_env(live, "claude", "--model", "demo")
    assert files == {} and unset == ["ANTHROPIC_API_KEY"] and run == ["claude", "--foo"]
    assert env["ANTHROPIC_BASE_URL"] == live.url and env["ANTHROPIC_AUTH_TOKEN"] == "gmlx"
    for name in (
        "MODEL",
        "SMALL_FAST_MODEL",
        *(f"DEFAULT_{t}_MODEL" for t in ("HAIKU", "SONNET", "OPUS")),
    ):
        assert env[f"ANTHROPIC_{name}"] == "demo"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(output_cap(window))
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(window)
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"


def test_print_env_codex(live, window):
    import tomllib

    env, files, _, run = print_env(live, "codex")  # no --model: the server's default
    home = launch_dir() / "codex"
    assert env == {"CODEX_HOME": str(home)} and run == ["codex", "--foo"]
    config = tomllib.loads(files[str(home / "config.toml")])
    assert config["model_provider"] == "gmlx" and config["model"] == "demo"
    assert config["model_context_window"] == window
    assert config["model_providers"]["gmlx"] == {
        "name": "gmlx",
        "base_url": f"{live.url}/v1",
        "wire_api": "responses",
    }


def test_print_env_pi(live, window):
    env, files, _, run = print_env(live, "pi", "-m", "demo")
    folder = launch_dir() / "pi"
    assert env == {"PI_CODING_AGENT_DIR": str(folder)}
    assert run == ["pi", "--provider", "gmlx", "--model", "demo", "--foo"]
    provider = json.loads(files[str(folder / "models.json")])["providers"]["gmlx"]
    assert provider["baseUrl"] == f"{live.url}/v1" and provider["api"] == "openai-completions"
    (model,) = provider["models"]
    assert model["id"] == "demo" and model["contextWindow"] == window
    assert model["maxTokens"] == output_cap(window)


def test_print_env_opencode_with_a_key(live, window):
    env, files, _, run = print_env(live, "opencode", "--model", "demo", "--api-key", "sk-x")
    path = launch_dir() / "opencode" / "opencode.json"
    assert env["OPENCODE_CONFIG"] == str(path) and env["GMLX_API_KEY"] == "sk-x"
    assert run == ["opencode", "--foo"]
    config = json.loads(files[str(path)])
    assert config["model"] == "gmlx/demo"
    provider = config["provider"]["gmlx"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    # The key stays in the environment; the file names it.
    assert provider["options"] == {"baseURL": f"{live.url}/v1", "apiKey": "{env:GMLX_API_KEY}"}
    assert provider["models"]["demo"]["limit"] == {"context": window, "output": output_cap(window)}


def test_the_printed_script_writes_what_it_shows(live, tmp_path):
    r = gmlx("launch", "codex", "--url", live.url, "--print-env")
    assert r.exit_code == 0, r.output
    script = tmp_path / "codex-env.sh"
    script.write_text(r.stdout)
    shown = parse_script(r.stdout)[1][str(launch_dir() / "codex" / "config.toml")]
    sourced = subprocess.run(
        ["sh", "-c", f'. "{script}" && cat "$CODEX_HOME/config.toml"'],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    assert sourced.stdout == shown


def test_print_env_names_what_the_server_serves(live):
    line = one_error_line(gmlx("launch", "pi", "--url", live.url, "--model", "nope", "--print-env"))
    assert "does not serve 'nope' (served: demo)" in line


# -- becoming the agent ----------------------------------------------------------------


FAKE_AGENT = """#!{python}
import json, os, sys
with open(os.environ["FAKE_AGENT_OUT"], "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
"""


@pytest.fixture
def fake_agents(tmp_path: Path) -> dict[str, str]:
    """A PATH whose agents are one script that records its argv and environment."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for agent in AGENTS.values():
        script = folder / agent.binary
        script.write_text(FAKE_AGENT.format(python=sys.executable))
        script.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        "FAKE_AGENT_OUT": str(tmp_path / "agent.json"),
        "ANTHROPIC_API_KEY": "sk-ant-real",
        "GMLX_DECODE_BATCH": "2",  # a server it starts warms two widths, not the default's
    }


def launch(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gmlx.cli.main", "launch", *args]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def seen(env: dict[str, str]) -> dict:
    return json.loads(Path(env["FAKE_AGENT_OUT"]).read_text())


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_launch_keeps_the_model_and_becomes_the_agent(name, live, fake_agents):
    expected = print_env(live, name, "--model", "demo")
    done = launch(fake_agents, name, "--model", "demo", "--url", live.url, "--", "--foo")
    assert done.returncode == 0, done.stderr
    assert "kept demo" in done.stderr
    assert demo_row(live.url)["kept"] is True

    env, files, unset, run = expected
    agent = seen(fake_agents)
    assert [Path(agent["argv"][0]).name, *agent["argv"][1:]] == run
    for key, value in env.items():
        assert agent["env"][key] == value
    for key in unset:
        assert key not in agent["env"]
    for path, text in files.items():  # what --print-env shows is what it wrote
        assert Path(path).read_text() == text


@pytest.fixture
def started_port() -> Iterator[int]:
    """A free port; a server launch left there is killed, whatever the test did."""
    import psutil

    port = free_port()
    yield port
    pid_file = launch_dir() / f"server-{port}.pid"
    if pid_file.exists():
        try:
            proc = psutil.Process(int(pid_file.read_text()))
            proc.kill()
            proc.wait(timeout=10)
        except psutil.Error:
            pass
        pid_file.unlink()


@pytest.mark.timeout(120)
def test_launch_starts_a_server_reuses_it_and_stops_it(fake_agents, started_port):
    url = f"http://127.0.0.1:{started_port}"
    first = launch(
        fake_agents, "claude", "--model", "demo", "--url", url, "--", "-p", "hi", timeout=90
    )
    assert first.returncode == 0, first.stderr
    log = launch_dir() / f"server-{started_port}.log"
    assert f"started a gmlx server at {url} (log: {log})" in first.stderr
    assert seen(fake_agents)["env"]["ANTHROPIC_BASE_URL"] == url
    pid = int((launch_dir() / f"server-{started_port}.pid").read_text())
    assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "healthy", "pid": pid}
    assert demo_row(url)["kept"] is True  # the server outlived the agent

    again = launch(fake_agents, "codex", "--url", url)  # the default model: demo
    assert again.returncode == 0, again.stderr
    assert "started" not in again.stderr and "kept demo (already resident" in again.stderr
    assert seen(fake_agents)["env"]["CODEX_HOME"] == str(launch_dir() / "codex")

    stopped = gmlx("launch", "--stop")
    assert stopped.exit_code == 0, stopped.output
    assert stopped.stdout == f"stopped the gmlx server on port {started_port} (pid {pid})\n"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
    assert gmlx("launch", "--stop").stdout.startswith("no gmlx server")


@pytest.mark.timeout(90)
def test_a_server_that_cannot_start_is_one_sentence(fake_agents, started_port):
    url = f"http://127.0.0.1:{started_port}"
    failed = launch(fake_agents, "pi", "--url", url)  # no model named, none configured
    assert failed.returncode == 1
    line = failed.stderr.splitlines()[-1]
    assert line.startswith(
        "error: The gmlx server exited with code 1 before it answered (Nothing to serve"
    )
    assert str(launch_dir() / f"server-{started_port}.log") in line
    assert not Path(fake_agents["FAKE_AGENT_OUT"]).exists()


# -- a real agent, end to end ------------------------------------------------------------


def real_agent(binary: str) -> str | None:
    """Where a real agent is installed: ``$GMLX_TEST_AGENTS/node_modules/.bin`` (what
    ``.ci/run`` installs) or the PATH."""
    folder = os.environ.get("GMLX_TEST_AGENTS")
    if folder and (path := Path(folder) / "node_modules" / ".bin" / binary).exists():
        return str(path.parent)
    found = shutil.which(binary)
    return str(Path(found).parent) if found else None


def test_pi_completes_a_turn_through_launch(live, tmp_path):
    """The real pi agent (`@mariozechner/pi-coding-agent`), started by `gmlx launch`,
    answers one prompt through the server: the request reaches the model and pi exits 0.
    `.ci/run` installs pi; elsewhere the test needs pi on PATH or GMLX_TEST_AGENTS."""
    folder = real_agent("pi")
    if folder is None:
        pytest.skip("the pi agent is not installed (npm install @mariozechner/pi-coding-agent; "
                    ".ci/run installs it and sets GMLX_TEST_AGENTS)")
    home = tmp_path / "home"
    home.mkdir()
    worker = live.app.state.registry.resident_worker("demo")
    before = worker.stats.requests_finished if worker else 0
    env = {**os.environ, "HOME": str(home), "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}
    done = launch(env, "pi", "--model", "demo", "--url", live.url, "--", "-p", "Say hi",
                  timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    worker = live.app.state.registry.resident_worker("demo")
    assert worker is not None and worker.stats.requests_finished > before
    assert not (home / ".pi").exists()  # the user's own agent folder is left alone
