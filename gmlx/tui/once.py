"""``gmlx top --once``: one snapshot as Rich text (header, models, requests).

Rich only, no Textual: the same cells as the dashboard (:mod:`gmlx.tui.view`)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gmlx.tui import view
from gmlx.tui.source import Poll

BAR_WIDTH = 60


def header(poll: Poll, url: str) -> Text:
    server = poll.server
    band = view.band(server)
    text = Text.assemble(
        ("gmlx top ", "bold"),
        url,
        f"  up {view.duration(server.get('uptime_s'))}  pid {server.get('pid')}\n",
        "governor ",
        ((band or "off").upper(), view.BAND_STYLES.get(band or "", "bold")),
        "  " + view.queue_line(server) + "\n",
        "mem ",
    )
    for glyphs, _ in view.memory_bar(server, BAR_WIDTH):
        text.append(glyphs)
    text.append("\n" + view.memory_legend(server))
    return text


def models_table(poll: Poll) -> Table:
    table = Table(box=None, pad_edge=False, title="resident models", title_justify="left")
    for label in view.MODEL_HEADERS:
        table.add_column(label, justify="left" if label in ("model", "marks") else "right")
    for m in view.model_rows(poll.server, poll.models):
        table.add_row(*view.model_cells(m))
    return table


def requests_table(poll: Poll) -> Table:
    table = Table(box=None, pad_edge=False, title="requests", title_justify="left")
    for c in view.REQUEST_COLUMNS:
        table.add_column(c.label, justify="right" if c.right else "left")
    for r in view.request_rows(list(poll.server.get("requests") or [])):
        table.add_row(*view.request_cells(r))
    return table


def render(poll: Poll, url: str) -> RenderableType:
    """The whole snapshot; a poll without requests says so instead of an empty table."""
    parts: list[RenderableType] = [header(poll, url), Text(""), models_table(poll), Text("")]
    if poll.server.get("requests"):
        parts.append(requests_table(poll))
    else:
        parts.append(Text("no requests in flight", style="dim"))
    return Group(*parts)
