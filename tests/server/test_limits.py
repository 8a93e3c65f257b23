"""Request limits: body size (413 before the body is read whole), message and stop counts
(400 naming the field), all from the ``server`` config section."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from live_server import LiveServer, serve_config

from gmlx.server.limits import BodyLimit

LIMITS = """\
server:
  max_body_bytes: 4096
  max_messages: 3
  max_stop: 2
"""
HI = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = serve_config(tmp_path_factory.mktemp("limits"), LIMITS)
    yield live
    live.stop()


def raw_post(url: str, path: str, head: dict[str, str], chunks: Iterator[bytes]) -> bytes:
    """POST over a plain socket, sending ``chunks`` until the server answers or closes;
    returns the whole answer. A client like this sees the refusal even when the server
    never reads the rest of its body."""
    parts = urlsplit(url)
    lines = [f"POST {path} HTTP/1.1", f"Host: {parts.hostname}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in head.items()), "", ""]
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode())
        sock.settimeout(0.05)  # a short poll between chunks: has the answer come?
        answer = b""
        for chunk in chunks:
            try:
                answer += sock.recv(65536)
            except TimeoutError:
                pass
            if answer:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(30)
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
    return answer


def parse(answer: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def megabytes(total: int, size: int = 1 << 20) -> Iterator[bytes]:
    """``total`` bytes of a chat body's text, ``size`` at a time."""
    for _ in range(total // size):
        yield b"x" * size


def test_a_64_mb_chat_body_is_refused_up_front_with_413(server):
    """The default limit (32 MiB): a declared 64 MB body is refused before it is read."""
    big = 64 << 20
    answer = raw_post(server.url, "/v1/chat/completions", {"Content-Length": str(big)}, megabytes(big))
    status, headers, body = parse(answer)
    assert status == 413 and headers["connection"] == "close"
    error = body["error"]
    assert error["type"] == "payload_too_large" and error["code"] == "payload_too_large"
    assert "server.max_body_bytes" in error["message"] and str(big) in error["message"]


def test_the_anthropic_route_refuses_in_its_shape(server):
    big = 64 << 20
    answer = raw_post(server.url, "/v1/messages", {"Content-Length": str(big)}, megabytes(big))
    status, _, body = parse(answer)
    assert status == 413
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"


def test_a_chunked_body_is_cut_at_the_limit(limited):
    """No Content-Length: the server reads until the body passes the limit, then answers."""

    def chunked() -> Iterator[bytes]:
        for _ in range(64 << 4):  # 64 MB in 64 KiB chunks, if the server never answered
            yield b"10000\r\n" + b"x" * 0x10000 + b"\r\n"

    answer = raw_post(limited.url, "/v1/chat/completions", {"Transfer-Encoding": "chunked"}, chunked())
    status, _, body = parse(answer)
    assert status == 413 and body["error"]["type"] == "payload_too_large"


def test_the_middleware_reads_at_most_one_chunk_past_the_limit():
    """Counted at the ASGI boundary: a client streaming forever is read to limit + one chunk."""
    pulled, sent = 0, []

    async def receive():
        nonlocal pulled
        pulled += 1000
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app ran")

    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}
    asyncio.run(BodyLimit(app, max_bytes=10_000)(scope, receive, send))
    assert pulled <= 10_000 + 1000
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["type"] == "request_too_large"


def test_a_body_within_the_limit_is_served(limited):
    r = httpx.post(f"{limited.url}/v1/chat/completions", timeout=30,
                   json={"model": "demo", "messages": [HI], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    big = {"model": "demo", "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    r = httpx.post(f"{limited.url}/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [HI] * 4}, "messages"),
        ("/v1/estimate", {"messages": [HI] * 4}, "messages"),
        ("/v1/responses", {"input": [HI] * 4}, "input"),
        ("/v1/chat/completions", {"messages": [HI], "stop": ["a", "b", "c"]}, "stop"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c"]}, "stop"),
    ],
)
def test_openai_list_limits_are_400s_naming_the_field(limited, path, body, param):
    r = httpx.post(f"{limited.url}{path}", json={"model": "demo", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert f"server.max_{'stop' if param == 'stop' else 'messages'}" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"messages": [HI] * 4}),
        ("/v1/messages/count_tokens", {"messages": [HI] * 4}),
        ("/v1/messages", {"messages": [HI], "stop_sequences": ["a", "b", "c"]}),
    ],
)
def test_anthropic_list_limits_are_400s(limited, path, body):
    r = httpx.post(f"{limited.url}{path}", json={"model": "demo", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_lists_at_the_limit_are_served(limited):
    body = {"model": "demo", "max_tokens": 2, "messages": [HI] * 3, "stop": ["a", "b"]}
    assert httpx.post(f"{limited.url}/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_the_limits_are_server_settings_with_env_overrides(monkeypatch):
    from gmlx.config import ServerSettings

    defaults = ServerSettings()
    assert defaults.max_body_bytes == 32 << 20 and defaults.max_messages == 4096
    assert defaults.max_stop == 16
    monkeypatch.setenv("GMLX_MAX_BODY_BYTES", "2048")
    assert ServerSettings().max_body_bytes == 2048
