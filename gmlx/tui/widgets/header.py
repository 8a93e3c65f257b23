"""The header: server, connection, governor band, memory bar, queue."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from gmlx.tui import view
from gmlx.tui.source import Poll, Trouble

BAR_STYLES = {
    "active": "magenta",
    "cache": "blue",
    "other": "grey50",
    "headroom": "green",
    "floor": "bold red",
}


class ServerHeader(Static):
    """What the server is doing as a whole, from the latest poll; while polls fail,
    since when and why (the last snapshot's numbers stay, marked stale)."""

    poll: reactive[Poll | None] = reactive(None, always_update=True)
    down_since: reactive[Poll | None] = reactive(None)  # the first failed poll of a run

    def __init__(self, url: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.url = url
        self.last_good: Poll | None = None

    def watch_poll(self, poll: Poll | None) -> None:
        if poll is not None and poll.error is None:
            self.last_good = poll
            self.down_since = None
        elif poll is not None and self.down_since is None:
            self.down_since = poll
        self.refresh_text()

    def on_resize(self) -> None:
        self.refresh_text()

    def status(self) -> Text:
        poll = self.poll
        if poll is None:
            return Text("connecting…", style="italic")
        if poll.error is None:
            return Text("● connected", style="green")
        since = self.down_since.at if self.down_since else poll.at
        if poll.error.trouble is Trouble.UNREACHABLE:
            return Text(f"✖ disconnected since {since:%H:%M:%S}", style="bold red")
        word = {Trouble.UNAUTHORIZED: "✖ key refused", Trouble.NOT_GMLX: "✖ not a gmlx server"}
        return Text(word.get(poll.error.trouble, "✖ refused"), style="bold red")

    def refresh_text(self) -> None:
        width = max(self.size.width, 40)
        poll, good = self.poll, self.last_good
        server = good.server if good else {}
        top = Text.assemble(("gmlx top ", "bold"), (self.url, "underline"), "  ", self.status())
        if server:
            top.append(f"  up {view.duration(server.get('uptime_s'))}  pid {server.get('pid')}")
        lines = [top]
        if poll is not None and poll.error is not None:
            lines.append(Text(poll.error.sentence, style="red"))
        if server:
            second = Text("governor ")
            band = view.band(server)
            second.append((band or "off").upper(), style=view.BAND_STYLES.get(band or "", "bold"))
            second.append("  " + view.queue_line(server))
            lines.append(second)
            bar = Text("mem ")
            for glyphs, part in view.memory_bar(server, width - 6):
                bar.append(glyphs, style=BAR_STYLES[part])
            lines += [bar, Text(view.memory_legend(server), style="dim")]
        self.update(Text("\n").join(lines))
