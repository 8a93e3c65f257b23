"""`gmlx top`: the Textual dashboard, built by :func:`build_app` from a data source.

The app never waits on the network in its UI: a timer starts a poll as a worker
(one at a time; a slow server skips ticks rather than piling them up), and the
worker posts a :class:`~gmlx.tui.messages.Polled` message that the app hands to its
widgets. Actions (cancel, unload, keep) run as workers the same way and report
with a notification.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Footer

from gmlx.tui import view
from gmlx.tui.messages import ActionFinished, FilterChanged, Polled
from gmlx.tui.source import ActionResult, MetricsSource, Poll
from gmlx.tui.widgets.counters import Counters
from gmlx.tui.widgets.filter_bar import FilterBar
from gmlx.tui.widgets.header import ServerHeader
from gmlx.tui.widgets.help_screen import HelpScreen
from gmlx.tui.widgets.models_table import ModelsTable
from gmlx.tui.widgets.rates import RatesPanel
from gmlx.tui.widgets.requests_table import RequestsTable

HISTORY_S = 180.0  # the sparklines cover the last three minutes


class TopApp(App[None]):
    """The live dashboard of one gmlx server (see :func:`build_app`)."""

    CSS_PATH = Path(__file__).with_name("top.tcss")
    TITLE = "gmlx top"
    ENABLE_COMMAND_PALETTE = False  # its ^p would take footer room from the keys
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "keys", key_display="?"),
        Binding("c", "cancel", "cancel"),
        Binding("u", "unload", "unload"),
        Binding("k", "keep", "keep"),
        Binding("slash", "filter", "filter", key_display="/"),
        Binding("s", "sort", "sort"),
        Binding("r", "reverse", "reverse", show=False),
    ]

    def __init__(self, source: MetricsSource, interval: float = 1.0) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.polling = False
        self.last: Poll | None = None

    def compose(self) -> ComposeResult:
        yield ServerHeader(self.source.url, id="header")
        yield ModelsTable(id="models")
        yield FilterBar()
        yield RequestsTable(id="requests")
        yield RatesPanel(samples=max(int(HISTORY_S / self.interval), 2), id="rates")
        yield Counters(id="counters")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(FilterBar).display = False
        self.query_one(RequestsTable).focus()
        self.tick()
        self.set_interval(self.interval, self.tick)

    async def on_unmount(self) -> None:
        await self.source.close()

    # -- polling ----------------------------------------------------------------------

    def tick(self) -> None:
        """Start a poll unless one is still out."""
        if not self.polling:
            self.polling = True
            self.run_worker(self._poll(), group="poll")

    async def _poll(self) -> None:
        try:
            poll = await self.source.poll()
        finally:
            self.polling = False
        self.post_message(Polled(poll))

    async def poll_now(self) -> Poll:
        """Poll once and show it, for tests and for right after an action."""
        poll = await self.source.poll()
        self.show(poll)
        return poll

    def on_polled(self, message: Polled) -> None:
        self.show(message.poll)

    def show(self, poll: Poll) -> None:
        header = self.query_one(ServerHeader)
        was_down = header.down_since is not None
        header.poll = poll
        self.last = poll
        self.screen.set_class(poll.error is not None, "-stale")
        counters = self.query_one(Counters)
        if poll.error is not None:
            counters.forget()
            return
        if was_down:
            self.notify("reconnected", timeout=3)
        server = poll.server
        self.query_one(ModelsTable).show(view.model_rows(server, poll.models))
        self.query_one(RequestsTable).show(list(server.get("requests") or []))
        self.query_one(RatesPanel).add(server)
        counters.observe(server)

    # -- actions ----------------------------------------------------------------------

    def _act(self, action: Any) -> None:
        async def run() -> None:
            self.post_message(ActionFinished(await action))

        self.run_worker(run(), group="actions")

    def on_action_finished(self, message: ActionFinished) -> None:
        result: ActionResult = message.result
        self.notify(result.sentence, severity="information" if result.ok else "error")
        self.tick()

    def action_cancel(self) -> None:
        request_id = self.query_one(RequestsTable).selected_request
        if request_id is None:
            self.notify("No request is selected.", severity="warning")
            return
        self.query_one(Counters).cancelled += 1
        self._act(self.source.cancel(request_id))

    def action_unload(self) -> None:
        model = self.query_one(ModelsTable).selected_model
        if model is None:
            self.notify("No model is resident.", severity="warning")
            return
        self._act(self.source.unload(model))

    def action_keep(self) -> None:
        row = self.query_one(ModelsTable).selected_row()
        if row is None:
            self.notify("No model is resident.", severity="warning")
            return
        self._act(self.source.keep(str(row["id"]), keep=not row.get("kept")))

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        bar = self.query_one(FilterBar)
        bar.display = True
        bar.focus()

    def on_filter_changed(self, message: FilterChanged) -> None:
        table = self.query_one(RequestsTable)
        table.model_filter = message.text
        bar = self.query_one(FilterBar)
        bar.display = bool(message.text)  # an applied filter stays in sight
        table.focus()

    def action_sort(self) -> None:
        self.query_one(RequestsTable).sort_next()

    def action_reverse(self) -> None:
        table = self.query_one(RequestsTable)
        table.reverse = not table.reverse


def build_app(source: MetricsSource, interval: float = 1.0) -> TopApp:
    """The dashboard over ``source``, polling every ``interval`` seconds."""
    return TopApp(source, interval=interval)
