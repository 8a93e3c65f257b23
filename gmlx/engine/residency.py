"""The models a server serves and the workers of those loaded: load, unload, keep.

A :class:`Registry` addresses requests through its :class:`ModelBook` (ids, aliases,
profiles) and runs one :class:`~gmlx.engine.worker.ModelWorker` per resident model.
A model loads on first use (or at start, :meth:`Registry.preload`) through the load
gate: it is priced from its files first (``sizing``), and idle models unload for it,
least recently used first, when it would not fit the free memory less the
governor's floor (``load_gate``). A model unloads when it has been idle longer than
its idle timeout (:meth:`Registry.reap`, on a thread from
:meth:`Registry.start_reaper`), when asked (:meth:`Registry.unload`), or for another
model; a pinned one only when asked, a kept one only for another model.

The registry also owns what the workers share: one memory :class:`Governor`, the
free-memory probe, and the boot capacity table, built for the first model that
loads (its geometry against the memory free at that moment); when that model
unloads, the next model to load builds it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gmlx.engine import capacity
from gmlx.engine.addressing import ModelBook, ModelSpec, Target
from gmlx.engine.governor import Governor, default_floor
from gmlx.engine.headroom import running_kv_bytes, total_memory, usable_bytes
from gmlx.engine.listing import ModelInfo, model_info
from gmlx.engine.load_gate import LoadGate
from gmlx.engine.model_start import Loads, WorkerSettings, start_model, warm_up
from gmlx.engine.profiles import Profile, ProfileBook
from gmlx.engine.reloading import ReloadResult, reload_result
from gmlx.engine.residents import Reaper, Residents, release_memory, settle
from gmlx.engine.sizing import Prices

if TYPE_CHECKING:
    from gmlx.engine.capacity import CapacityTable, Geometry
    from gmlx.engine.loading import LoadedModel
    from gmlx.engine.worker import ModelWorker

__all__ = ["KeepResult", "ModelInfo", "ModelSpec", "Registry", "Target"]

log = logging.getLogger("gmlx.engine")


@dataclass(frozen=True)
class KeepResult:
    """What :meth:`Registry.keep` did: whether this call loaded the model, and the
    seconds its warm-up took (None: not warmed by this call)."""

    model: str
    kept: bool
    resident: bool
    loaded: bool
    warmed_s: float | None


class Registry:
    """Configured models by id, their aliases and profiles, and one worker per loaded model.

    Args:
        specs: the models, in listing order.
        aliases: alias -> ``id`` or ``id@profile``; targets must resolve.
        profiles: the known profiles (built-in intents plus user profiles).
        decode_batch: the decode width of every worker (None: each model's from its
            capacity table, ``capacity.default_decode_batch``); the load gate prices
            KV for this many streams (1 when None).
        queue_cap: most requests waiting per worker (None: the worker's default).
        prompt_cache_bytes: each worker's prompt cache bound (None: the worker's
            default; 0: off).
        governor: True for a governor on ``probe`` (floor ``governor_floor_bytes``, else
            ``default_floor`` of the machine's memory), False for a disabled one, or
            a ready Governor. The load gate keeps its floor free (none when disabled).
        overcommit: no capacity table judges requests and no load gate judges loads
            (``GMLX_OVERCOMMIT=1``); the table is still built and reported.
        probe: the free working set in bytes (default ``capacity.free_bytes``).
        warmup: run each model's batch shapes once as it loads.
        idle_timeout: seconds a model may idle before it unloads, for specs that set
            none (0: never).
        clock: seconds, for last use and idle time (tests inject one).
        gate_wait_s: how long a load waits for memory an unload is still returning.
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        *,
        aliases: Mapping[str, str] | None = None,
        profiles: ProfileBook | None = None,
        decode_batch: int | None = None,
        queue_cap: int | None = None,
        prompt_cache_bytes: int | None = None,
        governor: Governor | bool = True,
        governor_floor_bytes: int | None = None,
        overcommit: bool = False,
        probe: Callable[[], int] | None = None,
        warmup: bool = False,
        idle_timeout: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        gate_wait_s: float = 3.0,
    ) -> None:
        self._book = ModelBook(specs, aliases, profiles)
        self.warmup = warmup
        self.decode_batch = decode_batch
        self.queue_cap = queue_cap
        self.prompt_cache_bytes = prompt_cache_bytes
        self.overcommit = overcommit
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.probe: Callable[[], int] = probe or capacity.free_bytes
        if isinstance(governor, Governor):
            self.governor = governor
        else:
            floor = governor_floor_bytes or default_floor(total_memory())
            self.governor = Governor(self.probe, floor_bytes=floor, enabled=governor)
        # ``_lock`` makes a reload one step; ``_gate`` makes loads one at a time (each
        # is priced against what the one before left).
        self._lock = threading.Lock()
        self._gate = threading.Lock()
        self._residents = Residents(clock)
        self._load_gate = LoadGate(self._residents, gate_wait_s)
        self._loads = Loads()
        self._prices = Prices()
        self._reaper = Reaper(self.reap)

    @property
    def capacity(self) -> CapacityTable | None:
        """The boot capacity table: the first resident model's, as measured when it
        loaded (None until one loads, and again after it unloads)."""
        return self._residents.capacity

    @property
    def capacity_model(self) -> str | None:
        """The model the boot table was built for."""
        return self._residents.capacity_model

    # -- addressing (through the current book) -----------------------------------

    @property
    def specs(self) -> dict[str, ModelSpec]:
        return self._book.specs

    @property
    def aliases(self) -> dict[str, Target]:
        return self._book.aliases

    @property
    def profiles(self) -> ProfileBook:
        return self._book.profiles

    @property
    def ids(self) -> list[str]:
        return self._book.ids

    def address(self, model: str | None, profile: str | None = None) -> Target:
        """Resolve a request's ``model`` (and optional ``profile`` field) to a target
        (see :meth:`ModelBook.address` for the rules and errors)."""
        return self._book.address(model, profile)

    def profile(self, target: Target, loaded: LoadedModel) -> Profile:
        """The effective profile of a target on its loaded model (family base included)."""
        return self.profiles.resolve(target.profile_name, loaded.config.get("model_type"))

    # -- loading -------------------------------------------------------------------

    def worker(self, model_id: str) -> ModelWorker:
        """The running worker of a model, loading it first if needed (blocks meanwhile),
        and marks the model used now (so the load gate leaves it alone for a moment:
        the caller is about to submit to it).

        Concurrent callers for one model wait for one load; a failed load raises its
        error to each of them and leaves nothing behind (the next call tries again).
        Errors: ModelNotFoundError, ModelSourceError from the loader, and
        ModelLoadDeferredError from the load gate.
        """
        return self._acquire(model_id)[0]

    def _acquire(self, model_id: str) -> tuple[ModelWorker, bool]:
        """The worker, and whether this call loaded it."""

        def resident() -> ModelWorker | None:
            entry = self._residents.use(model_id)
            return entry.worker if entry is not None else None

        spec = self._book.spec(model_id)
        return self._loads.run(model_id, resident, lambda: self._load(spec))

    def _load(self, spec: ModelSpec) -> ModelWorker:
        """Gate, load and register one model."""
        settings = WorkerSettings(
            self.decode_batch, self.queue_cap, self.prompt_cache_bytes, self.governor, self.warmup
        )
        with self._gate:
            self._admit(spec)
            try:
                entry = start_model(spec, settings, free_bytes=self.free_bytes, now=self.clock())
            except BaseException:
                release_memory()  # whatever the failed load allocated
                raise
            self._residents.register(entry, self._book.specs.get(spec.id))
            settle()  # the load's objects out of the cyclic collector's full passes
        return entry.worker

    def _admit(self, spec: ModelSpec) -> None:
        """Pass ``spec``'s model through the load gate (none under overcommit; a model
        that cannot be priced loads ungated)."""
        if self.overcommit:
            return
        size = self._prices.get(spec.source)
        if size is None:
            log.info(
                "%s: %s cannot be priced before it loads; it loads ungated", spec.id, spec.source
            )
            return
        floor = self.governor.floor_bytes if self.governor.enabled else 0
        self._load_gate.admit(
            spec, size, width=self.decode_batch or 1, probe=self.probe, floor=floor
        )

    def preload(self, model_ids: Iterable[str] | None = None) -> None:
        """Load the named models now (default: the pinned ones and those set to preload)."""
        ids = (
            list(model_ids)
            if model_ids is not None
            else [s.id for s in self.specs.values() if s.pinned or s.preload]
        )
        for model_id in ids:
            self.worker(model_id)

    def loading(self) -> list[str]:
        """The ids of the models loading right now."""
        return self._loads.ids()

    # -- residency -------------------------------------------------------------------

    def touch(self, model_id: str) -> None:
        """Mark a resident model used now (its idle time starts again)."""
        self._residents.use(model_id)

    def last_used(self, model_id: str) -> float | None:
        """When a resident model was last used, on the registry's clock (None: not resident)."""
        entry = self._residents.get(model_id)
        return entry.last_used if entry is not None else None

    def kept(self, model_id: str) -> bool:
        """Whether a resident model is kept past its idle timeout."""
        entry = self._residents.get(model_id)
        return entry is not None and entry.kept

    def keep(self, model_id: str, keep: bool = True, warm: bool = True) -> KeepResult:
        """Keep a model resident past its idle timeout (it stays evictable for another
        model under memory pressure), loading it through the gate if needed and, with
        ``warm``, compiling its decode shapes unless that was done when it loaded.
        ``keep=False`` releases it and never loads it. Errors as :meth:`worker`."""
        if not keep:
            self._book.spec(model_id)
            resident = self._residents.release(model_id)
            return KeepResult(model_id, kept=False, resident=resident, loaded=False, warmed_s=None)
        worker, loaded = self._acquire(model_id)
        entry, to_warm = self._residents.hold(worker, warm)
        if entry is None:  # unloaded or reloaded meanwhile
            return KeepResult(model_id, kept=False, resident=False, loaded=loaded, warmed_s=None)
        warmed_s = warm_up(entry) if to_warm else None
        if to_warm and warmed_s is None:
            entry.warmed = False
        return KeepResult(model_id, kept=True, resident=True, loaded=loaded, warmed_s=warmed_s)

    def unload(self, model_id: str) -> bool:
        """Unload a model now (a pinned one too: it stays pinned and loads again on its
        next request). True when it was resident. Raises ModelBusyError while it
        streams, ModelNotFoundError for an id that is neither served nor resident."""
        entries = self._residents.take_model(model_id)
        if not entries:
            self._book.spec(model_id)
            return False
        self._residents.close(entries, "on request")
        return True

    def unload_idle(self) -> list[str]:
        """Unload every resident model nothing streams on (pinned and kept ones too);
        returns their ids."""
        return self._residents.close(self._residents.take_idle(), "on request")

    def reap(self, now: float | None = None) -> list[str]:
        """Unload every model idle longer than its idle timeout (never a pinned or kept
        model, nor one whose timeout is 0) and every idle model a reload retired;
        returns their ids. A model seen streaming counts as used now, so idle time
        runs from the end of its last request (to within the reaper's interval)."""
        now = self.clock() if now is None else now
        return self._residents.close(self._residents.take_expired(now, self.idle_timeout), "idle")

    def start_reaper(self, interval_s: float = 1.0) -> None:
        """Run :meth:`reap` every ``interval_s`` on a daemon thread until :meth:`close`."""
        self._reaper.start(interval_s)

    def reconfigure(
        self,
        specs: Iterable[ModelSpec],
        aliases: Mapping[str, str] | None = None,
        profiles: ProfileBook | None = None,
    ) -> ReloadResult:
        """Serve ``specs``, ``aliases`` and ``profiles`` from now on (a config reload).

        A model whose load parameters (``ModelSpec.load_parameters``) did not change
        keeps its worker and residency; its other fields take effect at once. A
        removed or changed model leaves addressing now and its worker unloads once
        idle (now, if it is); a changed one loads anew on its next request. Raises
        ValueError for an alias that does not resolve, changing nothing.
        """
        book = ModelBook(specs, aliases, profiles)
        with self._lock:
            old, new = self._book.specs, book.specs
            self._book = book
            self._prices.clear()  # a reload is also how a replaced file is priced anew
            idle = self._residents.respec(new)
        self._residents.close(idle, "reloaded")
        for spec in new.values():  # here, so the next listing reads no file
            self._prices.get(spec.source)
        return reload_result(old, new)

    # -- what is resident (never loads, never counts as use) ------------------------

    def resident_worker(self, model_id: str) -> ModelWorker | None:
        """The worker of a model if it is loaded; never loads it."""
        entry = self._residents.get(model_id)
        return entry.worker if entry is not None else None

    def running(self, model_id: str) -> ModelWorker | None:
        """The worker of a resident model, without waiting (None: not loaded)."""
        return self.resident_worker(model_id)

    def resident(self, model_id: str) -> bool:
        return self._residents.get(model_id) is not None

    def workers(self) -> list[ModelWorker]:
        """The workers of the loaded models (those a reload retired, while they still
        stream, included)."""
        return [e.worker for e in self._residents.entries()]

    def geometry(self, model_id: str) -> Geometry | None:
        """A resident model's measured geometry (None: not loaded, or not measurable)."""
        entry = self._residents.get(model_id)
        return entry.geometry if entry is not None else None

    def free_bytes(self) -> int | None:
        """The memory requests may still use now (None when the probe fails): the free
        working set less the governor's reserve, twice its floor. Whatever fits this
        keeps the band at yellow or better, so a plan that says it fits is never shed.
        """
        return usable_bytes(self.probe, self.governor)

    def running_kv_bytes(self) -> int:
        """KV bytes the running requests of every worker hold now: what finishing
        them would give back (the drained working set is free memory plus this)."""
        return running_kv_bytes(self._residents.entries())

    def table_for_requests(self) -> CapacityTable | None:
        """The boot table when it may judge requests (None under overcommit)."""
        return None if self.overcommit else self.capacity

    def context_window(self, spec: ModelSpec) -> int | None:
        """A model's context window: the loaded one's while resident, else its trained
        window read off its files, lowered by ``max_kv_size`` (None: unknown)."""
        if (entry := self._residents.get(spec.id)) is not None:
            return entry.worker.loaded.context_length
        size = self._prices.get(spec.source)
        limits = [c for c in (size.context_length if size else None, spec.max_kv_size) if c]
        return min(limits) if limits else None

    def listing(self) -> list[ModelInfo]:
        """Every model id, then every alias, with their markers."""
        book = self._book
        rows = [self._info(spec.id, Target(spec)) for spec in book.specs.values()]
        rows += [self._info(alias, t, alias_of=t.spec.id) for alias, t in book.aliases.items()]
        return rows

    def _info(self, name: str, target: Target, alias_of: str | None = None) -> ModelInfo:
        spec = target.spec
        table = self.table_for_requests()
        return model_info(
            name,
            target,
            self._residents.get(spec.id),
            context_length=self.context_window(spec),
            at_width_1=table.max_ctx_at(1) if table and spec.id == self.capacity_model else None,
            now=self.clock(),
            alias_of=alias_of,
        )

    def close(self) -> None:
        """Stop the reaper and every worker (their requests finish as cancelled)."""
        self._reaper.stop()
        for entry in self._residents.take_all():
            entry.worker.close()
