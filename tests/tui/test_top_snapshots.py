"""The dashboard's layout pinned at 80x24 and 120x40 on the scripted source.

After a deliberate layout change: ``pytest tests/tui/test_top_snapshots.py
--snapshot-update``, then look at the SVGs it wrote before committing them.
"""

from __future__ import annotations

import pytest
from scripted_source import BUSY, DOWN, ScriptedSource

from gmlx.tui.app import TopApp, build_app

pytestmark = pytest.mark.timeout(60)

SIZES = [(80, 24), (120, 40)]


def busy_app() -> TopApp:
    # Three polls, so the sparklines have a shape; the clock is the script's.
    return build_app(ScriptedSource([BUSY]), interval=1000)


async def three_polls(pilot) -> None:  # type: ignore[no-untyped-def]
    await pilot.pause()
    await pilot.app.poll_now()
    await pilot.app.poll_now()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_busy_server(snap_compare, size):
    assert snap_compare(busy_app(), terminal_size=size, run_before=three_polls)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_disconnected(snap_compare, size):
    async def go_down(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.pause()
        await pilot.app.poll_now()
        await pilot.pause()

    app = build_app(ScriptedSource([BUSY, DOWN]), interval=1000)
    assert snap_compare(app, terminal_size=size, run_before=go_down)


def test_keys_at_80x24(snap_compare):
    assert snap_compare(busy_app(), terminal_size=(80, 24), press=["_", "question_mark"])
