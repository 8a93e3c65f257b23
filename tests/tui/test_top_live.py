"""`gmlx top` against a real server serving `demo`, with streams in flight."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer
from typer.testing import CliRunner

from gmlx.cli.main import app as cli
from gmlx.tui.app import build_app
from gmlx.tui.source import HttpSource, Trouble
from gmlx.tui.widgets.header import ServerHeader
from gmlx.tui.widgets.requests_table import RequestsTable

pytestmark = pytest.mark.timeout(120)

KEY = "sk-top-test"


@pytest.fixture(scope="module")
def server(gmlx_home) -> Iterator[LiveServer]:
    from gmlx.compose import build_app as build_server
    from gmlx.config import load_settings

    settings, _ = load_settings().with_models(["demo"])
    live = LiveServer.start(build_server(settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def key_server(gmlx_home) -> Iterator[LiveServer]:
    from gmlx.compose import build_app as build_server
    from gmlx.config import load_settings

    settings, _ = load_settings().with_models(["demo"])
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"api_key": KEY})}
    )
    live = LiveServer.start(build_server(settings))
    yield live
    live.stop()


class LongStream(threading.Thread):
    """A streamed chat request that runs until cancelled; ``finish`` is its last
    finish_reason once it ends."""

    def __init__(self, url: str, no_eos: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.url, self.no_eos = url, no_eos
        self.finish: str | None = None

    def run(self) -> None:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "Count forever."}],
            "max_tokens": 8000,
            "stream": True,
            "logit_bias": self.no_eos,
        }
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or []:
                        self.finish = choice.get("finish_reason") or self.finish


@pytest.fixture
def streams(server: LiveServer) -> Iterator[list[LongStream]]:
    worker = server.app.state.registry.worker("demo")
    no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
    running = [LongStream(server.url, no_eos) for _ in range(3)]
    for s in running:
        s.start()
    deadline = time.monotonic() + 20
    while sum(r["state"] == "decode" for r in worker.rows()) < 3:
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.02)
    yield running
    for row in worker.rows():  # whatever the test left running
        httpx.post(f"{server.url}/v1/requests/{row['id']}/cancel", timeout=10)
    for s in running:
        s.join(timeout=20)


@pytest.mark.anyio
async def test_the_table_shows_live_streams_and_c_cancels_one(server, streams):
    app = build_app(HttpSource(server.url), interval=1000)
    async with app.run_test(size=(120, 40)) as pilot:
        poll = await app.poll_now()
        assert poll.error is None, poll.error
        table = app.query_one(RequestsTable)
        assert table.row_count >= 3
        assert {str(table.get_row(k)[2]) for k in table.rows} == {"decode"}
        assert "● connected" in str(app.query_one(ServerHeader).render())
        victim = table.selected_request
        assert victim is not None
        await pilot.press("c")
        await app.workers.wait_for_complete()
        deadline = time.monotonic() + 10
        while all(s.is_alive() for s in streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a second stream ending now would be a wrong cancel
        assert [s.finish for s in streams if not s.is_alive()] == ["cancelled"]
        await app.poll_now()
        assert victim not in {str(k.value) for k in table.rows}
        assert table.row_count == 2


@pytest.mark.anyio
async def test_a_server_that_goes_away_shows_when(tmp_path):
    source = HttpSource("http://127.0.0.1:9", timeout=2.0)  # the discard port: nothing listens
    app = build_app(source, interval=1000)
    async with app.run_test(size=(80, 24)) as pilot:
        poll = await app.poll_now()
        await pilot.pause()
        assert poll.error is not None and poll.error.trouble is Trouble.UNREACHABLE
        # Since the first failed poll: the one the app started itself as it mounted.
        header = str(app.query_one(ServerHeader).render())
        assert re.search(r"disconnected since \d\d:\d\d:\d\d", header), header
        assert "Cannot reach a gmlx server at http://127.0.0.1:9" in header


@pytest.mark.anyio
async def test_a_refused_key_and_a_wrong_url_are_named(key_server, server):
    refused = await HttpSource(key_server.url, "wrong").poll()
    assert refused.error is not None and refused.error.trouble is Trouble.UNAUTHORIZED
    assert (await HttpSource(key_server.url, KEY).poll()).error is None
    not_gmlx = await HttpSource(f"{server.url}/v1").poll()  # /v1/v1/metrics is a 404
    assert not_gmlx.error is not None and not_gmlx.error.trouble is Trouble.NOT_GMLX


def test_once_prints_one_snapshot_and_json(server):
    runner = CliRunner()
    out = runner.invoke(cli, ["top", "--once", "--url", server.url])
    assert out.exit_code == 0, out.output
    assert "governor " in out.output and "running 0/" in out.output and "demo" in out.output
    raw = runner.invoke(cli, ["top", "--once", "--json", "--url", server.url])
    assert raw.exit_code == 0 and set(json.loads(raw.output)["server"]) >= {"requests", "rates"}


def test_once_without_a_server_is_one_sentence_and_exit_1():
    out = CliRunner().invoke(cli, ["top", "--once", "--url", "http://127.0.0.1:9"])
    assert out.exit_code == 1
    assert "Cannot reach a gmlx server at http://127.0.0.1:9" in out.output


@pytest.mark.anyio
async def test_keep_and_unload_say_what_the_server_did(server):
    # Last in the module: it leaves demo unloaded (it loads again on a request).
    source = HttpSource(server.url)
    assert (await source.keep("demo", keep=True)).sentence.startswith("kept demo")
    assert (await source.keep("demo", keep=False)).sentence.startswith("released demo")
    unloaded = await source.unload("demo")
    assert unloaded.ok and unloaded.sentence == "unloaded demo"
    assert (await source.poll()).server["resident_models"] == []
    missing = await source.unload("nope")
    assert not missing.ok and "nope" in missing.sentence
    await source.close()
