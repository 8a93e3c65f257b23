"""The capacity answers are honest: under a real MLX memory limit, the fan-out that
``/v1/capacity/plan`` says fits completes with no shed, and one step wider is refused
before anything is sent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from live_server import LiveServer

from gmlx.compose import build_app
from gmlx.config import load_settings
from gmlx.engine import capacity

MiB = 1024**2
DEPTH = 1024  # tokens each stream reaches: prompt + output
WIDTH = 4  # the fan-out the limit is sized for
FLOOR = 2 * MiB


@pytest.fixture
def limited_server(tmp_path: Path):
    """A server whose MLX memory is capped so that exactly WIDTH streams of DEPTH
    tokens fit the demo model beside the governor's reserve."""
    from gmlx.engine.loading import load_model

    geom = capacity.probe_geometry(load_model("demo"))
    chunk = 512
    need = WIDTH * capacity.kv_bytes(geom, DEPTH) + capacity.prefill_transient(geom, chunk, DEPTH)
    wider = 8 * capacity.kv_bytes(geom, DEPTH) + capacity.prefill_transient(geom, chunk, DEPTH)
    mx.synchronize()
    mx.clear_cache()
    # Room for the weights (loaded next), the plan's need and the reserve, and less
    # than the next tabulated width (8) would need.
    room = geom.weight_bytes + 2 * FLOOR + (need + wider) // 2
    previous = capacity.set_memory_limit(mx.get_active_memory() + room)
    path = tmp_path / "gmlx.yaml"
    path.write_text(f"server:\n  decode_batch: 8\n  governor_floor_bytes: {FLOOR}\n  prompt_cache_bytes: 0\n")
    settings, _ = load_settings(path).with_models(["demo"])
    live = LiveServer.start(build_app(settings))
    try:
        yield live
    finally:
        live.stop()
        capacity.set_memory_limit(None)
        mx.set_memory_limit(previous)


def test_the_planned_fan_out_completes_and_one_wider_is_refused(limited_server):
    import httpx

    registry = limited_server.app.state.registry
    worker = registry.worker("demo")
    with httpx.Client(base_url=limited_server.url, timeout=30) as http:
        fits = http.get("/v1/capacity/plan", params={"width": WIDTH, "depth": DEPTH}).json()
        wider = http.get("/v1/capacity/plan", params={"width": WIDTH + 1, "depth": DEPTH}).json()
    assert fits["ok"] is True and fits["admit_now"] is True, fits
    assert wider["ok"] is False and wider["reason"] == "geometry", wider

    tok = worker.loaded.tokenizer
    no_eos = {str(t): -100 for t in tok.eos_token_ids}
    messages = [{"role": "user", "content": "memory " * 200}]
    prompt_tokens = len(tok.encode_chat(messages))
    client = openai.AsyncOpenAI(base_url=f"{limited_server.url}/v1", api_key="x", timeout=120, max_retries=0)

    async def one() -> tuple[str, int]:
        r = await client.chat.completions.create(
            model="demo", messages=messages, max_tokens=DEPTH - prompt_tokens, temperature=0,
            logit_bias=no_eos)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    async def fan_out() -> list[tuple[str, int]]:
        return await asyncio.gather(*(one() for _ in range(WIDTH)))

    results = asyncio.run(fan_out())
    assert results == [("length", DEPTH - prompt_tokens)] * WIDTH
    assert registry.governor.sheds == 0
