"""``gmlx serve`` as a real process: it starts, logs what it serves, answers, stops."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
from live_server import start_serve


def test_serve_demo(gmlx_home):
    proc, url = start_serve("demo", ready="/health", timeout=60, probe_timeout=1)
    try:
        r = httpx.post(
            f"{url}/v1/chat/completions",
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
    assert url in out
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
    bad = runner.invoke(app, ["run", "demo@nope", *base])  # no such profile: one id, unknown
    assert bad.exit_code == 1 and "'demo@nope' is not a configured model" in str(bad.exception)
    bad = runner.invoke(app, ["run", "demo", "--profile", "nope", *base])
    assert bad.exit_code == 1 and "Unknown profile 'nope'" in str(bad.exception)


def test_decode_batch_flag_beats_env_and_file(tmp_path, monkeypatch):
    """`--decode-batch` wins over GMLX_DECODE_BATCH, which wins over server.decode_batch."""
    from typer.testing import CliRunner

    from gmlx.cli.main import app
    from gmlx.server import shutdown

    served = []
    monkeypatch.setattr(shutdown, "serve", lambda app, *args: served.append(app) or True)
    config = tmp_path / "gmlx.yaml"
    config.write_text("server: {decode_batch: 2}\nmodels: {demo: {source: demo, pinned: true}}\n")
    monkeypatch.setenv("GMLX_DECODE_BATCH", "5")
    runner = CliRunner()
    widths = []
    for flag in (["--decode-batch", "3"], []):
        result = runner.invoke(app, ["serve", "--config", str(config), *flag])
        assert result.exit_code == 0, result.output
        registry = served.pop().state.registry
        try:
            widths.append(registry.worker("demo").decode_batch)  # the app would load it at start
        finally:
            registry.close()
    assert widths == [3, 5]
    bad = runner.invoke(app, ["serve", "demo", "--decode-batch", "0"])
    assert bad.exit_code == 2
