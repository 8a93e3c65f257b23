"""``?``: the keys, over the dashboard."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("c", "cancel the selected request"),
    ("u", "unload the selected model"),
    ("k", "keep the selected model resident (again: release it)"),
    ("/", "filter the requests by model (Esc clears)"),
    ("s / r", "sort: next column / reverse (or click a header)"),
    ("tab", "move between the models and the requests"),
    ("?", "show or hide these keys"),
    ("q", "quit"),
)


class HelpScreen(ModalScreen[None]):
    """The key list; any of ``?``, Escape or ``q`` closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("question_mark,escape,q", "dismiss", "close", show=False),
    ]

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"{key:>6}  {what}" for key, what in KEYS)
        with Vertical(id="help"):
            yield Static("gmlx top — keys", id="help-title")
            yield Static(lines)
