"""`gmlx keep`, `gmlx unload` and `gmlx ps`: their help and usage errors, the lines they
print, and the story against a live server serving two demo models, `a` and `b`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from cli_runner import gmlx, one_error_line
from live_server import LiveServer, serve_config

from gmlx.cli.residency import human_idle, summary
from gmlx.replies import keep_line, refusal, unload_line

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens there
KEY = "sk-residency"
RESIDENCY_FIELDS = {"resident", "pinned", "kept", "in_flight", "waiting", "weight_bytes", "idle_s"}




# -- without a server ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("keep", ["--no-warm", "--release", "--url", "--api-key", "--json", "GMLX_URL"]),
        ("unload", ["--url", "--api-key", "--json", "GMLX_API_KEY"]),
        ("ps", ["--resident", "--url", "--api-key", "--json"]),
    ],
)
def test_help_names_the_flags_and_the_exit_codes(command, flags):
    r = gmlx(command, "--help")
    assert r.exit_code == 0
    for flag in flags:
        assert flag in r.stdout
    assert "Exit codes: 0 done; 1 failed or refused by the server; 2 usage error." in r.stdout
    assert "http://127.0.0.1:8080" in r.stdout


def test_root_help_lists_them_as_built():
    r = gmlx("--help")
    for command in ("keep", "unload", "ps"):
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith(f"│ {command} ")]
        assert "not built yet" not in line


@pytest.mark.parametrize(
    "args",
    [
        ["keep"],  # MODEL is required
        ["keep", "a", "--no-warm", "--release"],
        ["keep", "a", "b"],
        ["unload", "a", "b"],
        ["ps", "a"],
        ["ps", "--bogus"],
    ],
)
def test_usage_errors_exit_2(args):
    assert gmlx(*args).exit_code == 2


def test_keep_lines():
    kept = {"model": "qwen", "kept": True, "resident": True, "loaded": True, "warmed_s": 3.24}
    assert keep_line(kept) == "kept qwen (loaded now, warmed in 3.2 s)"
    again = {**kept, "loaded": False, "warmed_s": None}
    assert keep_line(again) == "kept qwen (already resident)"
    released = {**again, "kept": False}
    assert keep_line(released) == "released qwen (still resident; its idle timeout applies again)"
    assert keep_line({**released, "resident": False}) == "released qwen (not resident)"


def test_unload_lines():
    assert unload_line({"unloaded": ["a", "b"]}, None) == "unloaded a, b"
    assert unload_line({"unloaded": []}, "a") == "a was not resident; nothing unloaded"
    assert unload_line({"unloaded": []}, None) == "no idle model was resident; nothing unloaded"


def test_ps_summary_and_idle_times():
    rows = [
        {"id": "a", "resident": True, "weight_bytes": 3 * 2**20},
        {"id": "b", "resident": False, "weight_bytes": None},
        {"id": "coder", "resident": True, "weight_bytes": 3 * 2**20, "alias_of": "a"},
    ]
    assert summary(rows) == "1 of 2 models resident (3.0 MiB of weights)"
    assert [human_idle(s) for s in (None, 4.2, 600, 5400)] == ["—", "4 s", "10 min", "1.5 h"]


def test_refusals_are_the_servers_sentence_or_a_fallback():
    busy = {"error": {"message": "Model 'a' is streaming; retry later.", "type": "model_busy"}}
    assert refusal(409, busy, DOWN) == "Model 'a' is streaming; retry later."
    assert refusal(409, {}, DOWN) == "The model is streaming a request; retry when it finishes."
    assert (
        refusal(503, {"error": {}}, DOWN, "12") == "The server cannot take this now; retry in 12 s."
    )
    key = {"error": {"message": "Missing or wrong API key.", "type": "authentication_error"}}
    assert refusal(401, key, DOWN) == (
        "Missing or wrong API key: pass the server's key with --api-key or GMLX_API_KEY."
    )
    assert refusal(502, "bad gateway", DOWN) == f"The server at {DOWN} answered 502."


@pytest.mark.parametrize("args", [["ps"], ["keep", "a"], ["unload"], ["unload", "a", "--json"]])
def test_an_unreachable_server_is_one_sentence(args):
    line = one_error_line(gmlx(*args, "--url", DOWN))
    assert line.startswith(f"error: Cannot reach a gmlx server at {DOWN}: ")


def test_the_url_comes_from_gmlx_url():
    line = one_error_line(gmlx("ps", env={"GMLX_URL": "http://127.0.0.1:9/"}))
    assert "Cannot reach a gmlx server at http://127.0.0.1:9/" in line


# -- against a live server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveServer]:
    """A live server with `a` and `b` configured (both the demo model), none loaded.
    Models do not warm as they load, so `gmlx keep` is what warms them."""
    server = serve_config(
        tmp_path_factory.mktemp("residency-cli"),
        "server: {decode_batch: 2, warmup: false}\nmodels:\n  a: demo\n  b: demo\n",
        models=(),
    )
    yield server
    server.stop()


def ps_rows(url: str, *flags: str) -> dict[str, dict]:
    r = gmlx("ps", "--url", url, "--json", *flags)
    assert r.exit_code == 0, r.output
    return {row["id"]: row for row in json.loads(r.stdout)["data"]}


def test_ps_lists_every_configured_model(live):
    rows = ps_rows(live.url)
    assert set(rows) == {"a", "b"}
    for row in rows.values():
        assert RESIDENCY_FIELDS <= set(row)
    table = gmlx("ps", "--url", live.url)
    assert table.exit_code == 0, table.output
    assert "running" in table.stdout and "waiting" in table.stdout
    assert "0 of 2 models resident" in table.stdout


def test_keep_ps_unload_release(live):
    url = live.url
    kept = gmlx("keep", "a", "--url", url)
    assert kept.exit_code == 0, kept.output
    assert re.fullmatch(r"kept a \(loaded now, warmed in \d+\.\d s\)\n", kept.stdout)

    again = gmlx("keep", "a", "--no-warm", "--url", url, "--json")
    assert again.exit_code == 0, again.output
    body = json.loads(again.stdout)
    assert body["object"] == "keep" and body["model"] == "a"
    assert body["kept"] and body["resident"] and not body["loaded"] and body["warmed_s"] is None

    rows = ps_rows(url)
    assert rows["a"]["resident"] and rows["a"]["kept"] and rows["a"]["weight_bytes"] > 0
    assert not rows["b"]["resident"] and not rows["b"]["kept"]
    assert set(ps_rows(url, "--resident")) == {"a"}
    table = gmlx("ps", "--url", url, "--resident")
    assert "1 of 2 models resident" in table.stdout
    assert [ln.split()[0] for ln in table.stdout.splitlines()[1:-1]] == ["a"]

    unloaded = gmlx("unload", "a", "--url", url)
    assert unloaded.exit_code == 0, unloaded.output
    assert unloaded.stdout == "unloaded a\n"
    assert not ps_rows(url)["a"]["resident"]
    twice = gmlx("unload", "a", "--url", url, "--json")
    assert twice.exit_code == 0 and json.loads(twice.stdout) == {"object": "unload", "unloaded": []}

    released = gmlx("keep", "a", "--release", "--url", url)
    assert released.exit_code == 0, released.output
    assert released.stdout == "released a (not resident)\n"
    assert ps_rows(url)["a"]["kept"] is False


def test_unload_without_a_model_unloads_every_idle_one(live):
    done = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        timeout=60,
    )
    assert done.status_code == 200 and ps_rows(live.url)["b"]["resident"]
    r = gmlx("unload", "--url", live.url, "--json")
    assert r.exit_code == 0, r.output
    assert "b" in json.loads(r.stdout)["unloaded"]
    assert not any(row["resident"] for row in ps_rows(live.url).values())
    nothing = gmlx("unload", "--url", live.url)
    assert nothing.stdout == "no idle model was resident; nothing unloaded\n"


@pytest.mark.parametrize(
    "args", [["keep", "nope"], ["keep", "nope", "--release"], ["unload", "nope"]]
)
def test_an_unknown_model_is_the_servers_sentence(live, args):
    line = one_error_line(gmlx(*args, "--url", live.url))
    assert "nope" in line


def delta_text(line: str) -> str:
    """The text an SSE line of a chat stream carries ("" for the role chunk)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line.removeprefix("data: "))["choices"]
    return choices[0]["delta"].get("content") or "" if choices else ""


@contextmanager
def streaming(live: LiveServer, model: str) -> Iterator[None]:
    """A chat stream on ``model`` that runs until this block ends (the demo model is
    kept from ending it early); the stream is closed, which cancels it, on the way out."""
    worker = live.app.state.registry.worker(model)
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count forever."}],
        "max_tokens": 8000,
        "stream": True,
        "logit_bias": no_eos,
    }
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as r:
        # Wait for decoded text, not the role chunk: by then the request holds a slot and
        # has thousands of tokens to go. `lines` stays referenced: a dropped iterator
        # closes the response, which the server takes for a disconnect and cancels.
        lines = r.iter_lines()
        next(line for line in lines if delta_text(line))
        assert worker.in_flight, "the stream never started"
        yield
        lines.close()
    deadline = time.monotonic() + 10
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)


def test_unload_while_streaming_is_refused(live):
    assert gmlx("keep", "a", "--no-warm", "--url", live.url).exit_code == 0
    with streaming(live, "a"):
        line = one_error_line(gmlx("unload", "a", "--url", live.url))
        assert "streaming" in line and "retry" in line
        busy = ps_rows(live.url)["a"]
        assert busy["in_flight"] >= 1
    assert gmlx("unload", "a", "--url", live.url).stdout == "unloaded a\n"
    assert gmlx("keep", "a", "--release", "--url", live.url).exit_code == 0


def test_the_api_key_comes_from_the_flag_or_gmlx_api_key(tmp_path):
    keyed = serve_config(tmp_path, f"server: {{api_key: {KEY}}}\nmodels:\n  a: demo\n", models=())
    try:
        refused = one_error_line(gmlx("ps", "--url", keyed.url))
        assert "--api-key or GMLX_API_KEY" in refused
        assert gmlx("ps", "--url", keyed.url, "--api-key", KEY).exit_code == 0
        assert gmlx("ps", "--url", keyed.url, env={"GMLX_API_KEY": KEY}).exit_code == 0
        wrong = gmlx("ps", "--url", keyed.url, "--api-key", "nope", env={"GMLX_API_KEY": KEY})
        assert wrong.exit_code == 1  # the flag wins over the environment
    finally:
        keyed.stop()
