"""Files written after the work that needs them is done: an exclusive file lock that any
thread may release, and writer threads a caller can wait for.

The converted-weights cache (``convert_cache``) uses both: a first load returns as soon as
its weights are converted, and a thread writes the cache entry while holding the entry's
lock, so that another load of the same file waits for the entry instead of converting
again. The writers are not daemons: the interpreter waits for them at exit, so a process
that ends right after a load still leaves its entry.
"""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Callable
from pathlib import Path

_writers: list[threading.Thread] = []
_writers_lock = threading.Lock()


class FileLock:
    """An exclusive ``flock`` on ``path``, taken now (per open file, so threads exclude
    each other too), released by any thread, once."""

    def __init__(self, path: Path) -> None:
        self._fd = path.open("a")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._fd.close()
            raise

    def release(self) -> None:
        if not self._fd.closed:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._fd.close()


def write_behind(write: Callable[[], None], lock: FileLock) -> None:
    """Run ``write`` on a thread of its own, then release ``lock`` (at once if the
    thread cannot start)."""

    def run() -> None:
        try:
            write()
        finally:
            lock.release()

    thread = threading.Thread(target=run, name="gmlx-write-behind", daemon=False)
    with _writers_lock:
        _writers[:] = [t for t in _writers if t.is_alive()]
        try:
            thread.start()
        except BaseException:
            lock.release()
            raise
        _writers.append(thread)


def wait_for_writes(timeout: float | None = None) -> bool:
    """Wait for every write still running; False if one is still at it after
    ``timeout`` seconds."""
    with _writers_lock:
        pending = list(_writers)
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in pending:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in pending)
