"""``gmlx serve`` keeps an idle connection open longer than clients keep theirs in their
pools (httpx, under the OpenAI and Anthropic SDKs, 5 s), so a request a client sends on
a pooled connection after a pause is answered, not cut ("Server disconnected without
sending a response", as at uvicorn's default of 5 s)."""

from __future__ import annotations

import http.client
import time

from live_server import start_serve

from gmlx.server.shutdown import KEEP_ALIVE_S


def test_a_connection_idle_past_a_clients_pool_expiry_still_answers(gmlx_home):
    assert KEEP_ALIVE_S > 5
    proc, url = start_serve("demo")
    try:
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        conn.request("GET", "/health")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        time.sleep(6.0)  # longer than httpx's pool keeps a connection, and uvicorn's default
        conn.request("GET", "/health")  # on the same socket (http.client reconnects only once closed here)
        second = conn.getresponse()
        assert second.status == 200 and second.read() and conn.sock is sock
        conn.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
