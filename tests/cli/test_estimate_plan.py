"""`gmlx estimate` and `gmlx plan`: offline on the demo model, and against a live server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import serve_config
from typer.testing import CliRunner

from gmlx.cli.main import app

runner = CliRunner()
PROMPT = "Say hello, briefly."


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompt.txt"
    path.write_text(PROMPT)
    return path


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    """A live server with `demo` loaded and `cold` configured but never loaded."""
    live = serve_config(
        tmp_path_factory.mktemp("cli-server"),
        "server: {decode_batch: 2}\nmodels:\n  demo: {source: demo, default: true}\n  cold: demo\n",
    )
    yield live.url
    live.stop()


def gmlx(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_offline_on_demo(prompt_file, demo_model):
    r = gmlx("estimate", "demo", "--prompt-file", str(prompt_file), "--json")
    assert r.exit_code == 0, r.output
    est = json.loads(r.stdout)
    expected = demo_model.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    assert est["prompt_tokens"] == len(expected) and est["fits"] is True
    assert est["need_bytes"] > 0 and est["context_limit"] == 8192 and est["where"] == "local"
    table = gmlx("estimate", "demo", "-f", str(prompt_file))
    assert table.exit_code == 0 and "prompt_tokens" in table.stdout and "fits" in table.stdout
    too_long = gmlx("estimate", "demo", "-f", str(prompt_file), "--max-tokens", "9000", "--json")
    assert too_long.exit_code == 1 and json.loads(too_long.stdout)["context_ok"] is False


def test_estimate_reads_a_json_chat_body(tmp_path):
    body = {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": PROMPT},
        ],
        "max_tokens": 7,
    }
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    r = gmlx("estimate", "demo", "-f", str(path), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["max_tokens"] == 7


def test_plan_offline_on_demo():
    fits = gmlx("plan", "--width", "8", "--depth", "4000", "demo", "--json")
    assert fits.exit_code == 0, fits.output
    body = json.loads(fits.stdout)
    assert body["ok"] is True and body["max_ctx"] == 8192 and body["admit_now"] is None
    deep = gmlx("plan", "-w", "8", "-d", "32000", "demo")
    assert deep.exit_code == 1 and "does not fit" in deep.stdout and "8192" in deep.stdout


def test_estimate_against_a_server(url, prompt_file):
    r = gmlx("estimate", "demo", "-f", str(prompt_file), "--url", url, "--json")
    assert r.exit_code == 0, r.output
    est = json.loads(r.stdout)
    done = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=30,
        json={"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2},
    )
    assert est["resident"] is True and est["prompt_tokens"] == done.json()["usage"]["prompt_tokens"]
    again = json.loads(
        gmlx("estimate", "demo", "-f", str(prompt_file), "--url", url, "--json").stdout
    )
    assert again["cache_tier"] == "exact" and again["warm_tokens"] > 0
    cold = gmlx("estimate", "cold", "-f", str(prompt_file), "--url", url)
    assert cold.exit_code == 1 and "not loaded" in cold.stdout
    missing = gmlx("estimate", "nope", "-f", str(prompt_file), "--url", url)
    assert missing.exit_code == 1 and "not served here" in missing.stderr


def test_plan_against_a_server(url):
    ok = gmlx("plan", "-w", "2", "-d", "1000", "--url", url, "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["admit_now"] is True
    wide = gmlx("plan", "-w", "3", "-d", "1000", "--url", url)
    assert wide.exit_code == 0 and "should wait" in wide.stdout  # fits, but 2 slots
    deep = gmlx("plan", "-w", "1", "-d", "100000", "--url", url, "--json")
    assert deep.exit_code == 1 and json.loads(deep.stdout)["reason"] == "geometry"


def test_unreachable_server_is_one_sentence():
    r = gmlx("plan", "-w", "1", "-d", "10", "--url", "http://127.0.0.1:9")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith("error: Cannot reach a gmlx server at http://127.0.0.1:9")
    assert r.stderr.count("\n") == 1
