"""Counters: what the snapshot counts, and what `gmlx top` saw happen."""

from __future__ import annotations

from typing import Any

from textual.reactive import reactive
from textual.widgets import Static

from gmlx.tui import view


class Counters(Static):
    """Requests completed, cancelled, shed by the governor and refused by the queue,
    as the snapshot's ``counters`` section gives them. A server without that section
    is counted from here: ``finished`` is the request ids that left ``requests[]``
    between two polls (a request shorter than the poll interval is missed) and
    ``cancelled`` only this dashboard's cancels."""

    finished: reactive[int] = reactive(0)
    cancelled: reactive[int] = reactive(0)
    server: reactive[dict[str, Any]] = reactive(dict, always_update=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._live: set[str] | None = None

    def observe(self, server: dict[str, Any]) -> None:
        """Count the requests that left since the previous snapshot, then show this one."""
        live = {str(r.get("id")) for r in server.get("requests") or []}
        if self._live is not None:
            self.finished += len(self._live - live)
        self._live = live
        self.server = server

    def forget(self) -> None:
        """The server went away: requests it held then are not finished ones."""
        self._live = None

    def render(self) -> str:
        counted = self.server.get("counters")
        if counted:  # the server counts outcomes itself (since each model loaded)
            return (
                f"completed {view.count(counted.get('completed'))}  "
                f"cancelled {view.count(counted.get('cancelled'))}  "
                f"shed {view.count(counted.get('shed'))}  "
                f"refused {view.count(counted.get('refused'))}  "
                f"errors {view.count(counted.get('errors'))}"
            )
        gov = self.server.get("governor") or {}
        queue = self.server.get("queue") or {}
        return (
            f"finished {self.finished} (seen)  cancelled {self.cancelled} (here)  "
            f"shed {view.count(gov.get('sheds'))}  refused {view.count(queue.get('rejections'))}"
        )
