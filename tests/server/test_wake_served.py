"""``GMLX_WAKE_AT_HANDOVER=1`` through a real server: streams read by the official SDKs
while the worker holds their wake-ups for its next hand-over get the same text as from
the session's server without it, concurrent streams and an Anthropic stream included,
and a request after the server went idle is answered (a held wake-up would hang it)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from live_server import serve_config

from gmlx.engine import mailbox
from tests.server.conftest import CONFIG  # the session server's: its demo model as it serves it

PROMPTS = ["Hello", "Tell me a story", "Count to ten", "Why is the sky blue?"]


def _streamed(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _texts(url: str) -> tuple[list[str], str, str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # four streams decoding together, ending apart
        texts = list(pool.map(lambda a: _streamed(client, *a), zip(PROMPTS, (6, 14, 23, 31), strict=True)))
    claude = anthropic.Anthropic(base_url=url, api_key="unused", timeout=30, max_retries=0)
    with claude.messages.stream(model="demo", max_tokens=12, messages=[{"role": "user", "content": "Hi there"}],
                                extra_body={"temperature": 0}) as stream:
        message = "".join(stream.text_stream)
    return texts, message, _streamed(client, PROMPTS[0], 6)  # the last after the worker idled


def test_held_wakeups_serve_what_the_server_serves_without_them(tmp_path, monkeypatch: pytest.MonkeyPatch, server):
    want = _texts(server.url)
    monkeypatch.setenv(mailbox.ENV, "1")
    live = serve_config(tmp_path, CONFIG)
    try:
        got = _texts(live.url)
    finally:
        live.stop()
    assert got == want
    assert all(got[0]) and got[1] and got[2] == got[0][0]
