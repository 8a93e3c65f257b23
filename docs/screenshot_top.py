"""Regenerate ``docs/top.svg``: ``gmlx top`` watching a busy ``demo`` server.

    python docs/screenshot_top.py

Serves the built-in demo model on a free 127.0.0.1 port (in this process), keeps a few
streams decoding and more queued, runs the dashboard at 120x36 for a few polls, and
saves Textual's SVG screenshot. The numbers are whatever this machine measures.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from gmlx.compose import build_app
from gmlx.config import load_settings
from gmlx.tui.app import build_app as build_top
from gmlx.tui.source import HttpSource

OUT = Path(__file__).resolve().parent / "top.svg"
STREAMS = 6  # decode width 4: four decode, two wait


def serve() -> tuple[str, uvicorn.Server, threading.Thread]:
    settings, _ = load_settings().with_models(["demo"])
    server_settings = settings.server.model_copy(update={"decode_batch": 4, "warmup": False})
    app = build_app(settings.model_copy(update={"server": server_settings}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", params={"ready": 1}, timeout=1).status_code == 200:
                return url, server, thread
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    sys.exit("the demo server did not come up")


def stream(url: str, i: int, no_eos: dict[str, float]) -> None:
    body = {"model": "demo", "stream": True, "max_tokens": 4000, "logit_bias": no_eos,
            "messages": [{"role": "user", "content": f"Stream {i}: tell a long story."}]}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the screenshot is taken; the server goes away


async def shoot(url: str) -> None:
    app = build_top(HttpSource(url), interval=0.5)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(4.0)  # several polls: the sparklines fill a little
        app.save_screenshot(filename=OUT.name, path=str(OUT.parent))


def main() -> None:
    url, server, thread = serve()
    from gmlx.engine.loading import demo

    # Every end-of-sequence id biased away: the streams run on while the dashboard looks.
    no_eos = {str(t): -100.0 for t in demo.load_tokenizer().eos_token_ids}
    for i in range(STREAMS):
        threading.Thread(target=stream, args=(url, i, no_eos), daemon=True).start()
    time.sleep(1.0)
    asyncio.run(shoot(url))
    server.should_exit = True
    thread.join(30)  # its shutdown stops the model workers before the interpreter ends
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
