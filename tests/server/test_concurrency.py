"""Eight streams at once: all decode together, show in /v1/metrics, and finish whole."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from live_server import serve_config

WIDTH = 8
TOKENS = 200


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory):
    live = serve_config(tmp_path_factory.mktemp("wide"), f"server:\n  decode_batch: {WIDTH}\n")
    yield live
    live.stop()


def test_eight_concurrent_streams(wide_server):
    worker = wide_server.app.state.registry.worker("demo")
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    client = openai.AsyncOpenAI(base_url=f"{wide_server.url}/v1", api_key="x", timeout=120, max_retries=0)
    seen_in_flight: list[int] = []

    async def one(i: int) -> tuple[list, str | None, int]:
        stream = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=TOKENS,
            temperature=0.7, seed=i, logit_bias=no_eos, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        finish = next((c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason), None)
        usage = chunks[-1].usage.completion_tokens if chunks and chunks[-1].usage else -1
        return chunks, finish, usage

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=wide_server.url, timeout=10) as http:
            while not done.is_set():
                snap = (await http.get("/v1/metrics")).json()
                seen_in_flight.append(snap["server"]["concurrency"]["in_flight"])
                if snap["server"]["concurrency"]["in_flight"] == WIDTH:
                    states = {r["state"] for r in snap["server"]["requests"]}
                    assert len(snap["server"]["requests"]) == WIDTH and states <= {"prefill", "decode"}
                await asyncio.sleep(0.05)

    async def main():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        results = await asyncio.gather(*(one(i) for i in range(WIDTH)))
        done.set()
        await watcher
        return results

    results = asyncio.run(main())
    assert max(seen_in_flight) == WIDTH  # all eight decoding at once
    for chunks, finish, usage in results:
        assert chunks[0].choices[0].delta.role == "assistant"  # well-formed: role first
        assert finish == "length" and usage == TOKENS
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices) for chunks, _, _ in results]
    assert len(set(texts)) > 1  # each stream its own answer


@pytest.fixture(scope="module")
def narrow_server(tmp_path_factory):
    live = serve_config(tmp_path_factory.mktemp("narrow"), "server:\n  decode_batch: 1\n  sse_keepalive_s: 0.1\n")
    yield live
    live.stop()


def test_a_queued_stream_gets_keepalive_comments(narrow_server):
    """While a stream waits for a slot it is silent; comment lines keep it alive."""
    worker = narrow_server.app.state.registry.worker("demo")
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "logit_bias": no_eos}
    with (
        httpx.Client(base_url=narrow_server.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 1500}) as first,
    ):
        lines = first.iter_lines()  # kept referenced: closing it would end the response
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # the first stream holds the only slot now
        with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 3}) as second:
            seen: list[str] = []
            for line in second.iter_lines():
                seen.append(line)
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    break
                if len(seen) > 20 and any(s.startswith(": keep-alive") for s in seen):
                    break
        assert any(s.startswith(": keep-alive") for s in seen), seen[:10]

