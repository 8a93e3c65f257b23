"""Events crossing from a model's worker thread to the event loop that reads them.

A decode step of N streams posts N events; the first wakes the loop (a write to its
self-pipe, one callback) and the rest join that delivery. Where the wake-up lands matters
where the host paces a step (H100, 12-06: one stream before the rope and norm folds, 8
and 32 streams after them): the loop's turn (the events handed to their streams, a chunk written to
the client) needs the GIL, and the worker holds it while it builds its next step in
Python. Woken as the events are posted, the loop runs inside that build, which waits for
it (H100, 12-06: a served step's build took 0.9 ms against 0.67 for the same layers in
process). With ``GMLX_WAKE_AT_HANDOVER=1`` a worker thread holds its wake-ups
(:func:`hold`) and sends them (:func:`wake_held`) where it next hands a decode step to
the device (``mx.async_eval`` runs without the GIL for its whole hand-over, ~2 ms of an
8B's step on CUDA), and wherever it would otherwise wait or idle: a token reaches its
stream one graph build later, and the build no longer waits for the loop. Off by default:
served on an H100 (12-06 evening, 8B Q4_K_M) one stream was slower with it (268.5 tok/s
against 292-303) and 8 and 32 streams within the runs' spread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)

ENV = "GMLX_WAKE_AT_HANDOVER"

_held = threading.local()  # per worker thread: the mailboxes it posted to without a wake-up


def hold_enabled() -> bool:
    """Whether worker threads hold their wake-ups for the hand-over (``GMLX_WAKE_AT_HANDOVER=1``)."""
    return os.environ.get(ENV, "0") == "1"


def hold() -> None:
    """From now on, events this thread posts wait for :func:`wake_held` to wake their loop."""
    _held.boxes = set()


def release() -> None:
    """Wake what this thread holds and post with a wake-up again."""
    wake_held()
    _held.boxes = None


def wake_held() -> None:
    """Wake the loops this thread posted to since its last call (none when not holding)."""
    boxes = getattr(_held, "boxes", None)
    if boxes:
        for box in list(boxes):
            box.wake()
        boxes.clear()


class Mailbox:
    """Events bound for one event loop, handed over in batches: the first event posted
    while no delivery is scheduled schedules one callback on the loop (or, from a thread
    that holds its wake-ups, waits for that thread's :func:`wake_held`), the ones posted
    before it runs join it. A decode step of N streams wakes the loop once, not N times."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[Any, Any]] = []
        self._waking = False  # a delivery is scheduled on the loop
        self._lock = threading.Lock()

    def post(self, handle: Any, event: Any) -> None:
        """Called on a worker thread: ``handle._push(event)`` on the loop, in order."""
        with self._lock:
            self._items.append((handle, event))
            if self._waking:
                return
            boxes = getattr(_held, "boxes", None)
            if boxes is None:
                self._waking = True
        if boxes is None:
            self._schedule()
        else:
            boxes.add(self)

    def wake(self) -> None:
        """Schedule the delivery of what is posted, unless one is scheduled already."""
        with self._lock:
            if self._waking or not self._items:
                return
            self._waking = True
        self._schedule()

    def _schedule(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._items.clear()
                self._waking = False

    def _deliver(self) -> None:
        """On the event loop: every event posted so far, in order."""
        with self._lock:
            items, self._items = self._items, []
            self._waking = False
        for handle, event in items:
            try:
                handle._push(event)
            except Exception:  # one stream's failure must not lose the others' events
                log.exception("cannot deliver an event of %s", handle.id)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's mailbox."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = Mailbox(loop)
        return box
