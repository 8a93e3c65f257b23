"""``gmlx serve`` stopped by SIGTERM or Ctrl-C while it streams: new requests get a
typed 503, streams finish within the grace period or end with their protocol's error
event (never a normal finish), the port is released and the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from live_server import start_serve

NO_EOS: dict[str, int] = {}  # filled from the demo tokenizer on first use


def no_eos() -> dict[str, int]:
    if not NO_EOS:
        from gmlx.engine.loading import load_model

        NO_EOS.update({str(t): -100 for t in load_model("demo").tokenizer.eos_token_ids})
    return NO_EOS


@contextmanager
def serving(*flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    proc, url = start_serve("demo", *flags)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def port_is_free(url: str) -> bool:
    """Whether a new server could listen on the port (as uvicorn does, reusing an
    address whose closed connections linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            s.listen()
        except OSError:
            return False
    return True


def openai_stream(client: httpx.Client, url: str, max_tokens: int):
    return client.stream("POST", f"{url}/v1/chat/completions", json={
        "model": "demo", "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "logit_bias": no_eos(), "messages": [{"role": "user", "content": "Write a long story."}],
    })


def anthropic_stream(client: httpx.Client, url: str, max_tokens: int):
    return client.stream("POST", f"{url}/v1/messages", json={
        "model": "demo", "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a long story."}],
    })


def until_text(lines: Iterator[str], marker: str) -> list[str]:
    """The stream's lines up to the first that holds ``marker`` (its first text)."""
    seen = []
    for line in lines:
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"the stream ended before any text: {seen}")


def test_sigterm_cuts_streams_with_the_protocols_error_event_and_exits_0(gmlx_home):
    with serving("--shutdown-timeout", "0") as (proc, url), httpx.Client(timeout=60) as client:
        with openai_stream(client, url, 8000) as oa, anthropic_stream(client, url, 8000) as an:
            oa_lines, an_lines = oa.iter_lines(), an.iter_lines()
            until_text(oa_lines, '"content":')
            until_text(an_lines, "content_block_delta")
            proc.send_signal(signal.SIGTERM)
            oa_rest, an_rest = "\n".join(oa_lines), "\n".join(an_lines)
        assert proc.wait(timeout=60) == 0
    oa_error = json.loads(next(line for line in oa_rest.splitlines() if '"error"' in line)[len("data: "):])
    assert oa_error["error"]["type"] == "server_shutting_down"
    assert oa_error["error"]["code"] == "server_shutting_down"
    assert "shut down" in oa_error["error"]["message"]
    assert '"finish_reason":"stop"' not in oa_rest and '"finish_reason":"length"' not in oa_rest
    assert "event: error" in an_rest and '"type":"overloaded_error"' in an_rest
    assert "message_stop" not in an_rest and "end_turn" not in an_rest
    assert port_is_free(url)


def test_ctrl_c_refuses_new_requests_lets_streams_finish_and_exits_0(gmlx_home):
    with serving("--shutdown-timeout", "120") as (proc, url), httpx.Client(timeout=60) as client:
        with openai_stream(client, url, 8000) as long, openai_stream(client, url, 300) as short:
            long_lines, short_lines = long.iter_lines(), short.iter_lines()
            until_text(long_lines, '"content":')
            until_text(short_lines, '"content":')
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 60  # draining shows as a 503 on /health
            while (health := httpx.get(f"{url}/health", timeout=10)).status_code != 503:
                assert time.monotonic() < deadline, health.text
                time.sleep(0.05)
            assert health.json()["error"]["type"] == "server_shutting_down"
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
                "model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 503 and chat.json()["error"]["code"] == "server_shutting_down"
            assert "Retry-After" in chat.headers
            message = httpx.post(f"{url}/v1/messages", timeout=10, json={
                "model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert message.status_code == 503
            assert message.json()["type"] == "error"
            assert message.json()["error"]["type"] == "overloaded_error"
            rest = "\n".join(short_lines)  # the stream in flight finishes within the grace
            assert '"finish_reason":"length"' in rest and rest.rstrip().endswith("data: [DONE]")
            assert '"error"' not in rest
            assert proc.poll() is None  # the long stream is still in flight: no exit yet
        # the long stream's client leaves: nothing is in flight, the server stops
        assert proc.wait(timeout=60) == 0
    assert port_is_free(url)


def test_a_second_sigterm_cuts_the_grace_period_short_without_tracebacks(gmlx_home):
    """The first SIGTERM drains (a long grace period); the second cuts the stream in
    flight at once with the protocol's error event, and the log says so in one line."""
    with serving("--shutdown-timeout", "120") as (proc, url), httpx.Client(timeout=60) as client:
        with openai_stream(client, url, 8000) as oa:
            lines = oa.iter_lines()
            until_text(lines, '"content":')
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/health", timeout=10).status_code != 503:  # draining
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            rest = "\n".join(lines)
        assert proc.wait(timeout=30) == 0
        log = proc.stdout.read() if proc.stdout else ""
    error = json.loads(next(line for line in rest.splitlines() if '"error"' in line)[len("data: "):])
    assert error["error"]["type"] == "server_shutting_down"
    assert "stopped before this request finished" in error["error"]["message"]
    assert '"finish_reason":"stop"' not in rest and '"finish_reason":"length"' not in rest
    assert "a second SIGTERM: stopping now: cutting 1 requests still in flight" in log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert port_is_free(url)
