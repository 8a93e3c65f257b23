"""The requests filter: part of a model id, typed after ``/``."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.widgets import Input

from gmlx.tui.messages import FilterChanged


class FilterBar(Input):
    """An input shown by ``/``: Enter applies the filter, Escape clears it; either
    hides the bar and hands the keys back to the tables."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "clear", "clear filter", show=False)]

    def __init__(self) -> None:
        super().__init__(placeholder="show requests of models containing…", id="filter")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(FilterChanged(event.value.strip()))

    def action_clear(self) -> None:
        self.value = ""
        self.post_message(FilterChanged(""))
