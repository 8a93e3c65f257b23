"""The messages `gmlx top`'s parts send each other: small dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from gmlx.tui.source import ActionResult, Poll


@dataclass
class Polled(Message):
    """A poll came back (with a snapshot or with the reason it has none)."""

    poll: Poll


@dataclass
class ActionFinished(Message):
    """A cancel, unload or keep came back."""

    result: ActionResult


@dataclass
class FilterChanged(Message):
    """The requests filter (a part of a model id) changed; empty shows every request."""

    text: str
