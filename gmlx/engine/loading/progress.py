"""What a model load is doing now: its phase and how far, for whoever shows it (the
CLI's progress bars, ``/v1/models`` ``loading``).

A load runs on one thread; :func:`loading` names the model that thread loads, and the
loaders report on it with :func:`phase` and :func:`advance` without knowing who
listens. Phases: ``read`` (the file's header, or an MLX folder through mlx-lm),
``convert`` (GGUF tensors converted, counted) or ``cached`` (converted weights read
back), ``vision`` (a vision tower), ``compile`` (the warm-up's shapes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

Listener = Callable[[str, "LoadStatus"], None]


@dataclass(frozen=True)
class LoadStatus:
    """A load's phase, and its progress where it counts (``done`` of ``total``)."""

    phase: str
    done: int = 0
    total: int | None = None


_lock = threading.Lock()
_status: dict[str, LoadStatus] = {}
_listeners: list[Listener] = []
_current = threading.local()


@contextmanager
def loading(model_id: str) -> Iterator[None]:
    """Report this thread's phases as ``model_id``'s until the block ends."""
    previous = getattr(_current, "model_id", None)
    _current.model_id = model_id
    try:
        yield
    finally:
        _current.model_id = previous
        with _lock:
            _status.pop(model_id, None)


def phase(name: str, total: int | None = None) -> None:
    """The current load enters phase ``name`` (with ``total`` steps, if it counts)."""
    _set(lambda _: LoadStatus(name, 0, total))


def advance(steps: int = 1) -> None:
    """The current phase did ``steps`` more of its total."""
    _set(lambda s: replace(s, done=s.done + steps) if s is not None else None)


def status(model_id: str) -> LoadStatus | None:
    with _lock:
        return _status.get(model_id)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Call ``listener(model_id, status)`` on every change while the block runs (on
    the loading thread: keep it short)."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def _set(change: Callable[[LoadStatus | None], LoadStatus | None]) -> None:
    model_id = getattr(_current, "model_id", None)
    if model_id is None:
        return  # not a load anyone watches (a test loading a file directly)
    with _lock:
        new = change(_status.get(model_id))
        if new is None:
            return
        _status[model_id] = new
        listeners = list(_listeners)
    for listener in listeners:
        listener(model_id, new)
