"""``gmlx serve`` stopped by SIGTERM with requests still queued behind a running one:
each queued request ends with the typed ``server_shutting_down`` error in its form (a
stream's error event, never a normal finish; a whole answer's 503), nothing is left in
the worker, and the process exits 0 with the port released. (Running requests alone:
tests/server/test_shutdown.py, whose server helpers these tests use.)"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from test_shutdown import anthropic_stream, openai_stream, port_is_free, serving


def queued_rows(url: str) -> int:
    rows = httpx.get(f"{url}/v1/metrics", timeout=10).json()["server"]["requests"]
    return sum(1 for r in rows if r["state"] == "queued")


def read_all(client: httpx.Client, opener, url: str, max_tokens: int, out: list[str]) -> None:
    """Read a stream to its end, as a client keeping pace would (a stalled reader is cut)."""
    with opener(client, url, max_tokens) as stream:
        out.extend(stream.iter_lines())


def test_sigterm_ends_queued_requests_with_the_typed_error_and_exits_0(gmlx_home):
    running, queued, queued_an = [], [], []
    whole: list[httpx.Response] = []
    with serving("--decode-batch", "1", "--shutdown-timeout", "0") as (proc, url), \
            httpx.Client(timeout=60) as client:
        readers = [threading.Thread(target=read_all, args=(client, openai_stream, url, 8000, running))]
        readers[0].start()
        deadline = time.monotonic() + 30  # its first text: the one slot is taken
        while not any('"content":' in line for line in list(running)):
            assert time.monotonic() < deadline and readers[0].is_alive(), running
            time.sleep(0.02)
        readers += [threading.Thread(target=read_all, args=(client, openai_stream, url, 50, queued)),
                    threading.Thread(target=read_all, args=(client, anthropic_stream, url, 50, queued_an)),
                    threading.Thread(target=lambda: whole.append(httpx.post(
                        f"{url}/v1/chat/completions", timeout=60,
                        json={"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})))]
        for reader in readers[1:]:
            reader.start()
        while queued_rows(url) < 3:  # all three wait behind the running one
            assert time.monotonic() < deadline, httpx.get(f"{url}/v1/metrics").text
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
        assert proc.wait(timeout=60) == 0
    queued_rest, queued_an_rest = "\n".join(queued), "\n".join(queued_an)
    error = json.loads(next(line for line in queued if '"error"' in line)[len("data: "):])
    assert error["error"]["type"] == error["error"]["code"] == "server_shutting_down"
    assert '"finish_reason":"' not in queued_rest  # no normal finish: the answer never began
    assert queued_rest.rstrip().endswith("data: [DONE]")
    assert "event: error" in queued_an_rest and '"type":"overloaded_error"' in queued_an_rest
    assert "message_stop" not in queued_an_rest
    (r,) = whole
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert '"server_shutting_down"' in "\n".join(running)  # the running one is cut too
    assert port_is_free(url)
