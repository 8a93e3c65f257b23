"""Decode and prefill tok/s over the last minutes, as sparklines."""

from __future__ import annotations

from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import Label, Sparkline

from gmlx.tui import view


class RatesPanel(Widget):
    """Two sparklines fed one sample per poll: the aggregate decode rate now
    (``rates.decode_tok_s``) and the recent prefill rate (``rates.prefill_tok_s_recent``,
    the mean over the last eight requests: the snapshot has no live prefill rate)."""

    def __init__(self, samples: int = 180, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decode: deque[float] = deque(maxlen=samples)
        self.prefill: deque[float] = deque(maxlen=samples)

    def compose(self) -> ComposeResult:
        with Horizontal(classes="rate"):
            yield Label("decode  —", id="decode-label")
            yield Sparkline([], id="decode-spark")
        with Horizontal(classes="rate"):
            yield Label("prefill —", id="prefill-label")
            yield Sparkline([], id="prefill-spark")

    def add(self, server: dict[str, Any]) -> None:
        """Take one sample from a snapshot's ``rates`` section."""
        rates = server.get("rates") or {}
        decode, prefill = rates.get("decode_tok_s"), rates.get("prefill_tok_s_recent")
        self.decode.append(float(decode or 0.0))
        self.prefill.append(float(prefill or 0.0))
        streams = rates.get("decode_streams")
        self.query_one("#decode-label", Label).update(
            f"decode  {view.rate(decode):>7} tok/s ({view.count(streams)} streams)"
        )
        self.query_one("#prefill-label", Label).update(
            f"prefill {view.rate(prefill):>7} tok/s (recent)"
        )
        self.query_one("#decode-spark", Sparkline).data = list(self.decode)
        self.query_one("#prefill-spark", Sparkline).data = list(self.prefill)
