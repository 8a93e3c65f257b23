"""``gmlx serve`` as a real process: it starts, logs what it serves, answers, stops."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_demo(gmlx_home):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gmlx.cli.main", "serve", "demo", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gmlx serve did not come up"
            time.sleep(0.1)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={
                "model": "demo",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "serving demo" in out
    assert f"http://127.0.0.1:{port}" in out
    assert f"config: {gmlx_home / 'gmlx.yaml'} (not found: empty config)" in out


def test_serve_with_nothing_to_serve_fails():
    result = subprocess.run(
        [sys.executable, "-m", "gmlx.cli.main", "serve"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "Nothing to serve" in result.stderr


def test_run_takes_profiles_like_the_server():
    from typer.testing import CliRunner

    from gmlx.cli.main import app

    runner = CliRunner()
    base = ["-p", "Hello", "-n", "6"]
    suffix = runner.invoke(app, ["run", "demo@deterministic", *base])
    option = runner.invoke(app, ["run", "demo", "--profile", "deterministic", *base])
    greedy = runner.invoke(app, ["run", "demo", "-t", "0", *base])
    assert suffix.exit_code == 0, suffix.output
    assert suffix.stdout == option.stdout == greedy.stdout
    bad = runner.invoke(app, ["run", "demo@nope", *base])
    assert bad.exit_code == 1 and "Unknown profile 'nope'" in str(bad.exception)
