"""The resident models of a registry and what residency records about them.

:class:`Residents` holds one :class:`Resident` entry per loaded model id, the entries
a config reload retired (still streaming, they unload once idle), each model's last
use and keep flag, the boot capacity table and when a model last unloaded. One lock
guards all of it, and it is never held while a worker closes.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gmlx.engine import capacity
from gmlx.engine.errors import ModelBusyError

if TYPE_CHECKING:
    from gmlx.engine.addressing import ModelSpec
    from gmlx.engine.capacity import CapacityTable, Geometry
    from gmlx.engine.worker import ModelWorker

log = logging.getLogger("gmlx.engine")

RECENT_UNLOAD_S = 5.0  # an unload's memory may take this long to show as free again
# A model handed out (``Registry.worker``) or touched this recently is about to receive
# a request: unloading it for another model would fail that request.
EVICT_GRACE_S = 2.0


@dataclass(eq=False)
class Resident:
    """A loaded model and its residency state (guarded by the ``Residents`` lock)."""

    spec: ModelSpec  # the current spec (load parameters as loaded)
    worker: ModelWorker
    last_used: float  # on the registry's clock
    geometry: Geometry | None = None
    table: CapacityTable | None = None  # its capacity table, as measured when it loaded
    kept: bool = False
    warmed: bool = False
    boot_table: bool = False  # the registry's boot capacity table is this one's

    @property
    def busy(self) -> bool:
        """Whether it streams: requests generating, or submitted and waiting."""
        w = self.worker
        return w.in_flight > 0 or w.waiting_for_slot > 0 or w.waiting > 0

    def idle_s(self, now: float) -> float | None:
        """Seconds since its last use (None while it streams)."""
        return None if self.busy else max(0.0, now - self.last_used)


def eviction_order(
    entries: Iterable[Resident], now: float
) -> tuple[list[Resident], list[Resident]]:
    """Which resident models may unload for another, in the order they should go, and
    which block the load (pinned, streaming, or used within ``EVICT_GRACE_S``).

    Idle models go least recently used first; kept ones only after every other.
    """
    free, blockers = [], []
    for entry in entries:
        if entry.spec.pinned or entry.busy or now - entry.last_used < EVICT_GRACE_S:
            blockers.append(entry)
        else:
            free.append(entry)
    free.sort(key=lambda e: (e.kept, e.last_used))
    return free, blockers


class Residents:
    """Resident entries by model id, on ``clock`` (seconds)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.capacity: CapacityTable | None = None  # the boot table, of ``capacity_model``
        self.capacity_model: str | None = None
        self._current: dict[str, Resident] = {}
        self._retiring: list[Resident] = []  # removed or changed by a reload; go once idle
        self._last_unload: float | None = None

    # -- reads (a dict lookup needs no lock) ---------------------------------------

    def get(self, model_id: str) -> Resident | None:
        """The current entry of a model (None: not resident)."""
        return self._current.get(model_id)

    def entries(self) -> list[Resident]:
        """Every entry, current ones then retiring ones."""
        with self._lock:
            return self._all()

    def _all(self) -> list[Resident]:
        return [*self._current.values(), *self._retiring]

    def recently_unloaded(self, now: float) -> bool:
        """Whether a model unloaded within ``RECENT_UNLOAD_S``: its memory may still be
        on its way back."""
        last = self._last_unload
        return last is not None and now - last <= RECENT_UNLOAD_S

    # -- use ---------------------------------------------------------------------

    def use(self, model_id: str) -> Resident | None:
        """The current entry of a model, marked used now (None: not resident)."""
        with self._lock:
            if (entry := self._current.get(model_id)) is not None:
                entry.last_used = self.clock()
            return entry

    def hold(self, worker: ModelWorker, warm: bool) -> tuple[Resident | None, bool]:
        """Keep the model ``worker`` runs (None when it is no longer its model's current
        worker), and whether the caller should warm it: asked to, and not warmed yet
        (a concurrent keep then does not warm it again)."""
        with self._lock:
            entry = self._current.get(worker.loaded.id)
            if entry is None or entry.worker is not worker:
                return None, False
            entry.kept = True
            to_warm = warm and not entry.warmed
            entry.warmed = entry.warmed or to_warm
            return entry, to_warm

    def release(self, model_id: str) -> bool:
        """Stop keeping a model; whether it is resident."""
        with self._lock:
            if (entry := self._current.get(model_id)) is not None:
                entry.kept = False
            return entry is not None

    def register(self, entry: Resident, current: ModelSpec | None) -> bool:
        """Add a freshly loaded entry: as the model's current one when ``current`` (the
        model's spec now) has the load parameters it loaded with, else as retiring (a
        reload changed it meanwhile: it serves its caller, then goes). The first
        current entry with a capacity table gives the boot table. True when current."""
        with self._lock:
            if current is None or current.load_parameters != entry.spec.load_parameters:
                self._retiring.append(entry)
                return False
            entry.spec = current
            entry.last_used = self.clock()
            self._current[current.id] = entry
            if self.capacity is None and entry.table is not None:
                self.capacity, self.capacity_model = entry.table, current.id
                entry.boot_table = True
                log.info(
                    "capacity (%s): budget %s, max context %s by width",
                    current.id,
                    capacity.human(entry.table.budget_bytes),
                    ", ".join(f"{w}: {c}" for w, c in entry.table.max_ctx.items()),
                )
            return True

    def respec(self, specs: Mapping[str, ModelSpec]) -> list[Resident]:
        """Follow a reload to ``specs``: an entry whose model is gone or whose load
        parameters changed retires, the others take their new spec. Returns the
        retiring entries that are idle, detached (the caller closes them)."""
        with self._lock:
            for model_id, entry in list(self._current.items()):
                spec = specs.get(model_id)
                if spec is None or spec.load_parameters != entry.spec.load_parameters:
                    del self._current[model_id]
                    self._retiring.append(entry)
                else:
                    entry.spec = spec
            return self._detach_all([e for e in self._retiring if not e.busy])

    # -- taking entries out --------------------------------------------------------

    def take_for_room(self, entry: Resident) -> bool:
        """Detach ``entry`` to make room for another model, if it still may go (it may
        have been used since the gate chose it). True when it was detached."""
        with self._lock:
            victims, _ = eviction_order(self._all(), self.clock())
            if entry not in victims:
                return False
            self._detach(entry)
            return True

    def take_model(self, model_id: str) -> list[Resident]:
        """Detach every entry of a model (current and retiring); raises ModelBusyError
        while one streams, detaching none."""
        with self._lock:
            entries = [e for e in self._all() if e.spec.id == model_id]
            if busy := [e for e in entries if e.busy]:
                w = busy[0].worker
                raise ModelBusyError(
                    f"Model {model_id!r} is streaming ({w.in_flight} in flight, "
                    f"{w.waiting_for_slot} waiting), so it cannot unload now; retry once "
                    "its requests finish, or cancel them.",
                    param="model",
                )
            return self._detach_all(entries)

    def take_idle(self) -> list[Resident]:
        """Detach every entry nothing streams on."""
        with self._lock:
            return self._detach_all([e for e in self._all() if not e.busy])

    def take_expired(self, now: float, default_timeout: float) -> list[Resident]:
        """Detach every entry idle longer than its idle timeout (``default_timeout`` for
        a spec without one; 0: never), except pinned and kept ones, and every idle
        retiring one. An entry seen streaming counts as used ``now``."""
        with self._lock:
            expired = [e for e in self._retiring if not e.busy]
            for entry in self._current.values():
                if entry.busy:
                    entry.last_used = max(entry.last_used, now)
                    continue
                spec = entry.spec
                timeout = default_timeout if spec.idle_timeout is None else spec.idle_timeout
                if (
                    not (spec.pinned or entry.kept)
                    and timeout > 0
                    and now - entry.last_used > timeout
                ):
                    expired.append(entry)
            return self._detach_all(expired)

    def take_all(self) -> list[Resident]:
        with self._lock:
            return self._detach_all(self._all())

    def _detach_all(self, entries: Iterable[Resident]) -> list[Resident]:
        taken = list(entries)
        for entry in taken:
            self._detach(entry)
        return taken

    def _detach(self, entry: Resident) -> None:
        """Take an entry out, and the boot table with it (the lock is held)."""
        if self._current.get(entry.spec.id) is entry:
            del self._current[entry.spec.id]
        elif entry in self._retiring:
            self._retiring.remove(entry)
        if entry.boot_table:
            self.capacity, self.capacity_model = None, None

    def close(self, entries: list[Resident], why: str) -> list[str]:
        """Stop detached entries' workers and give their memory back; returns their ids.
        ``entries`` is emptied, so the models' arrays go with the workers."""
        ids = []
        while entries:
            entry = entries.pop(0)
            entry.worker.close()
            ids.append(entry.spec.id)
            log.info("unloaded %s (%s)", entry.spec.id, why)
            del entry
        if ids:
            release_memory()
            with self._lock:
                self._last_unload = self.clock()
        return ids


class Reaper:
    """Calls ``reap`` every so often on a daemon thread, from :meth:`start` to :meth:`stop`."""

    def __init__(self, reap: Callable[[], object]) -> None:
        self._reap = reap
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, interval_s: float) -> None:
        """Start reaping every ``interval_s`` (nothing when it already runs)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="gmlx-reaper", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self._reap()
            except Exception:  # the reaper must outlive one bad unload
                log.exception("idle unload failed")


def settle() -> None:
    """Take everything alive now (a model just loaded and warmed, the server's own
    modules) out of the cyclic collector's passes (``gc.freeze``), after collecting what
    the load left unreachable.

    Why: a full collection walks every object the process tracks: with the demo model
    loaded, ``gmlx serve`` tracks ~170,000 and a full pass took 64-72 ms on this 2-core
    CPU. Serving one stream, the demo model's tokens start one every ~9 s, each a 64 ms
    stall of every thread that needs the GIL (the model worker's step with them; on a
    GPU, the device idles meanwhile), and the young generations' passes cost ~18 us a
    token more. Frozen objects are still freed when their last reference goes; only
    cycles among them wait, for :func:`release_memory` (an unload), which unfreezes
    before it collects."""
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """Collect what an unload left unreachable (what :func:`settle` froze included) and
    return MLX's buffer cache to the system, on any backend."""
    gc.unfreeze()
    settle()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # an older MLX, or no backend: nothing to return
        log.debug("cannot clear MLX's buffer cache", exc_info=True)
