"""Threads for MLX work that the event loop hands off: loading, warming, unloading.

``asyncio.to_thread`` runs calls on the loop's default executor, whose threads exit when
the interpreter shuts down. A thread that ran MLX work holds per-thread MLX state whose
destructor takes the GIL as the thread exits; during finalization that kills the
process (SIGABRT, "terminate called without an active exception"). The threads here
never exit: between calls they wait on a queue, holding no GIL, and die quietly with the
process, as the model workers' threads do (``gmlx.engine.worker``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

MAX_THREADS = 4  # loads serialise on the registry's lock; keep and unload may run beside one

_jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
_threads: list[threading.Thread] = []
_idle = 0  # threads waiting for a job
_lock = threading.Lock()


def _serve() -> None:
    global _idle
    while True:
        future, fn, args = _jobs.get()
        with _lock:
            _idle -= 1
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                future.set_exception(e)
        del future, fn, args  # a finished load's arrays are not held here
        with _lock:
            _idle += 1


def submit(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run ``fn(*args)`` on one of the long-lived MLX threads."""
    global _idle
    future: Future[T] = Future()
    with _lock:
        if _idle == 0 and len(_threads) < MAX_THREADS:
            thread = threading.Thread(target=_serve, name=f"gmlx-mlx-{len(_threads)}", daemon=True)
            _threads.append(thread)
            _idle += 1
            thread.start()
        _jobs.put((future, fn, args))
    return future


async def run(fn: Callable[..., T], *args: Any) -> T:
    """``await`` ``fn(*args)`` run on a long-lived MLX thread (see the module docstring):
    what ``asyncio.to_thread`` would do, for calls that touch MLX."""
    return await asyncio.wrap_future(submit(fn, *args))


# A finished worker thread never returns: it parks here. MLX keeps a compile cache
# per thread whose destructor takes the GIL when the thread exits; a thread that
# exits while the interpreter finalizes is killed inside that destructor and the
# process aborts. A parked thread holds no GIL and dies quietly with the process.
_PARK = threading.Event()


def run_then_park(holder: list[Callable[[], Any]]) -> None:
    """A thread's target: run the one callable in ``holder`` (taken out, so that the
    thread keeps no reference to it and an unloaded model is freed), then park."""
    run = holder.pop()
    run()
    del run
    _PARK.wait()
