"""The dashboard driven by a scripted source: what it shows, its keys, and a server
that goes away and comes back."""

from __future__ import annotations

import pytest
from scripted_source import BUSY, DOWN, KEY_REFUSED, ScriptedSource, metrics, request

from gmlx.tui.app import TopApp, build_app
from gmlx.tui.widgets.counters import Counters
from gmlx.tui.widgets.header import ServerHeader
from gmlx.tui.widgets.help_screen import HelpScreen
from gmlx.tui.widgets.models_table import ModelsTable
from gmlx.tui.widgets.requests_table import RequestsTable

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]


def header_text(app: TopApp) -> str:
    return str(app.query_one(ServerHeader).render())


def request_ids(app: TopApp) -> list[str]:
    table = app.query_one(RequestsTable)
    return [str(key.value) for key in table.rows]


async def test_it_shows_the_header_models_and_requests():
    app = build_app(ScriptedSource([BUSY]), interval=1000)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        text = header_text(app)
        assert "http://gmlx.test" in text and "● connected" in text and "up 1h 02m" in text
        assert "governor GREEN" in text and "queue 1/32" in text and "eta 4.5 s" in text
        assert "active 6.0 GiB" in text and "floor 2.0 GiB" in text
        models = app.query_one(ModelsTable)
        assert models.get_row("qwen")[:3] == ["qwen", "pinned default", "1/8"]
        assert models.get_row("demo")[1] == "kept"
        # Queued rows first, as the server orders them.
        assert request_ids(app) == ["req-a1c0de", "req-b2e4f1", "req-c3d9a7", "req-d4f2b8"]
        row = [str(c) for c in app.query_one(RequestsTable).get_row("req-b2e4f1")]
        assert row == [
            "b2e4f1",
            "qwen",
            "decode",
            "1200",
            "300/2048",
            "0.42s",
            "38.5",
            "block 1024",
            "12 s",
        ]
        assert "shed 1" in str(app.query_one(Counters).render())
        assert "refused 3" in str(app.query_one(Counters).render())


async def test_sorting_by_key_and_by_header_click():
    app = build_app(ScriptedSource([BUSY]), interval=1000)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        table = app.query_one(RequestsTable)
        table.sort_key = "elapsed_s"
        await pilot.pause()
        assert request_ids(app) == ["req-c3d9a7", "req-a1c0de", "req-b2e4f1", "req-d4f2b8"]
        await pilot.press("r")
        assert request_ids(app)[0] == "req-d4f2b8"
        await pilot.press("s")  # the next column after elapsed: the server's order again
        assert table.sort_key is None
        assert request_ids(app)[0] == "req-a1c0de"


async def test_clicking_a_header_sorts_by_it_and_again_reverses():
    app = build_app(ScriptedSource([BUSY]), interval=1000)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        table = app.query_one(RequestsTable)
        table.reverse = False
        x = sum(table.columns[k].get_render_width(table) for k in list(table.columns)[:4]) + 2
        await pilot.click(RequestsTable, offset=(x, 1))  # the border is row 0, headers row 1
        await pilot.pause()
        assert table.sort_key == "generated"
        assert request_ids(app)[0] in ("req-a1c0de", "req-c3d9a7")
        await pilot.click(RequestsTable, offset=(x, 1))
        await pilot.pause()
        assert table.reverse and request_ids(app)[0] == "req-d4f2b8"


async def test_the_cursor_stays_on_its_request_across_polls():
    later = metrics([r for r in BUSY["server"]["requests"] if r["id"] != "req-a1c0de"])
    app = build_app(ScriptedSource([BUSY, later]), interval=1000)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("down", "down")
        assert app.query_one(RequestsTable).selected_request == "req-c3d9a7"
        await app.poll_now()
        assert app.query_one(RequestsTable).selected_request == "req-c3d9a7"
        assert "finished 1 (seen)" in str(app.query_one(Counters).render())


async def test_slash_filters_the_requests_by_model_and_escape_clears():
    app = build_app(ScriptedSource([BUSY]), interval=1000)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("slash", "d", "e", "m", "enter")
        await pilot.pause()
        assert request_ids(app) == ["req-c3d9a7", "req-d4f2b8"]
        assert isinstance(app.focused, RequestsTable)
        await pilot.press("slash", "escape")
        await pilot.pause()
        assert len(request_ids(app)) == 4


async def test_question_mark_shows_the_keys():
    app = build_app(ScriptedSource([BUSY]), interval=1000)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        shown = " ".join(str(s.render()) for s in app.screen.query("Static"))
        assert "cancel the selected request" in shown and "quit" in shown
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_keys_act_on_the_selected_request_and_model():
    source = ScriptedSource([BUSY])
    app = build_app(source, interval=1000)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("down", "c")
        await pilot.press("shift+tab", "down", "u", "k")  # to the models table, its demo row
        await app.workers.wait_for_complete()
        assert source.actions == [("cancel", "req-b2e4f1"), ("unload", "demo"), ("release", "demo")]
        assert "cancelled 1 (here)" in str(app.query_one(Counters).render())


async def test_a_server_that_goes_away_and_comes_back():
    app = build_app(ScriptedSource([BUSY, DOWN, DOWN, BUSY]), interval=1000)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await app.poll_now()
        await app.poll_now()  # still down: the time is the first failure's
        text = header_text(app)
        assert "disconnected since 09:30:01" in text and "connection refused" in text
        assert app.screen.has_class("-stale")
        assert request_ids(app)  # the last snapshot stays, dimmed
        await app.poll_now()
        await pilot.pause()
        assert "● connected" in header_text(app) and not app.screen.has_class("-stale")


async def test_a_refused_key_is_said_plainly():
    app = build_app(ScriptedSource([KEY_REFUSED]), interval=1000)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        text = header_text(app)
        assert "key refused" in text and "--api-key" in text


async def test_no_model_and_no_request_is_no_error():
    empty = metrics([], resident_models=[])
    source = ScriptedSource([empty])
    app = build_app(source, interval=1000)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("c", "u", "k")
        await pilot.pause()
        assert source.actions == []


def test_scripted_rows_are_the_real_shape():
    row = request("req-x", "demo", "decode")
    assert set(row) == {
        "id",
        "model",
        "state",
        "position",
        "prompt_tokens",
        "generated",
        "max_tokens",
        "elapsed_s",
        "ttft_s",
        "decode_tok_s",
        "cache",
        "speculative",
    }
