"""Events crossing from a model's worker thread to the event loop that reads them.

A decode step of N streams posts N events; the first wakes the loop (a write to its
self-pipe, one callback) and the rest join that delivery. Where the wake-up lands matters
where the host paces a step (H100, 12-06: one stream before the rope and norm folds, 8
and 32 streams after them): the loop's turn (the events handed to their streams, a chunk written to
the client) needs the GIL, and the worker holds it while it builds its next step in
Python. Woken as the events are posted, the loop runs inside that build, which waits for
it (H100, 12-06: a served step's build took 0.9 ms against 0.67 for the same layers in
process). A worker that held its wake-ups until it next handed a step to the device
(``GMLX_WAKE_AT_HANDOVER=1``, 12-06) served one stream slower (268.5 tok/s against
292-303, H100, 8B Q4_K_M) and 8 and 32 streams within the runs' spread; removed 12-07.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)


class Mailbox:
    """Events bound for one event loop, handed over in batches: the first event posted
    while no delivery is scheduled schedules one callback on the loop, the ones posted
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
