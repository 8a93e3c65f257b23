"""A client that stops reading its stream: the server's backlog for it stays bounded,
the stream is cut with a typed error and its slot is freed."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from gmlx.engine import requests as engine_requests
from gmlx.server import sse

BACKLOG = 64


@pytest.fixture
def small_buffer_server(gmlx_home, monkeypatch):
    """A real server whose listening socket has a small send buffer (the accepted
    connections inherit it), so a client that stops reading blocks the server's sends
    after a few kilobytes rather than megabytes."""
    from gmlx.compose import build_app
    from gmlx.config import load_settings

    monkeypatch.setattr(engine_requests, "MAX_BACKLOG", BACKLOG)
    monkeypatch.setattr(sse, "CUT_SEND_S", 60.0)  # the test takes the closing frames
    settings, _ = load_settings().with_models(["demo"])
    app = build_app(settings)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and app.state.starting is not None and app.state.starting.done()):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield app, sock.getsockname()
    server.should_exit = True
    thread.join(timeout=15)


def metrics(address) -> dict:
    return httpx.get(f"http://{address[0]}:{address[1]}/v1/metrics", timeout=10).json()["server"]


def wait_for(address, predicate, what: str) -> dict:
    deadline = time.monotonic() + 60
    while not predicate(snap := metrics(address)):
        assert time.monotonic() < deadline, f"waited in vain for {what}: {snap}"
        time.sleep(0.05)
    return snap


def test_a_client_that_stops_reading_is_cut_and_its_slot_freed(small_buffer_server):
    app, address = small_buffer_server
    worker = app.state.registry.workers()[0]
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    body = json.dumps({
        "model": "demo", "stream": True, "max_tokens": 6000, "temperature": 0, "logit_bias": no_eos,
        "messages": [{"role": "user", "content": "Write a very long story."}],
    }).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.settimeout(60)
    client.connect(address)
    try:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                       b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                       + b"\r\n\r\n" + body)
        assert client.recv(64).startswith(b"HTTP/1.1 200")  # then it reads no more
        wait_for(address, lambda s: s["requests"], "the request to start")
        snap = wait_for(address, lambda s: not s["requests"] and s["concurrency"]["in_flight"] == 0,
                        "the slow stream's slot to be freed")
        assert snap["concurrency"]["waiting"] == 0
        assert worker.stats.finish_reasons.get("cancelled") == 1
        received = bytearray()
        while chunk := client.recv(65536):  # the client reads again: the stream's end
            received += chunk
            if received.endswith(b"0\r\n\r\n"):
                break
    finally:
        client.close()
    text = received.decode(errors="replace")
    assert '"code":"client_too_slow"' in text and "too slowly" in text
    assert '"finish_reason":"stop"' not in text and '"finish_reason":"length"' not in text
    # what the server held for this stream stayed bounded: it carried a few socket
    # buffers' worth, far fewer than the 6000 tokens asked, and then stopped
    assert text.count('"delta"') < 2000
