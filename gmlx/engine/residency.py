"""The models a server serves: their ids, aliases, profiles, and the workers of those loaded.

A :class:`Registry` knows every configured model (:class:`ModelSpec`) and turns the
``model`` string of a request into a :class:`Target` (which model, which profile),
following the addressing rules: an exact id or alias first, then ``id@profile``
split on the last ``@`` when the suffix names a known profile. A model loads on
first use (or at start, through :meth:`Registry.preload`) and then runs on its own
:class:`~gmlx.engine.worker.ModelWorker`.

The registry also owns what the workers share: one memory :class:`Governor`, the
free-memory probe, and the boot capacity table, built for the first model that
loads (its geometry against the memory free at that moment).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gmlx.engine import capacity
from gmlx.engine.errors import InvalidRequestError, ModelNotFoundError
from gmlx.engine.governor import Governor, default_floor
from gmlx.engine.profiles import Profile, ProfileBook
from gmlx.engine.scheduling import DEFAULT_DECODE_BATCH

if TYPE_CHECKING:
    from gmlx.engine.capacity import CapacityTable, Geometry
    from gmlx.engine.loading import LoadedModel
    from gmlx.engine.worker import ModelWorker

log = logging.getLogger("gmlx.engine")


def _total_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: where it comes from and how to load and present it."""

    id: str
    source: str  # ``demo``, a GGUF file, an MLX folder, ``hf:org/repo[/file]`` (cache only)
    max_kv_size: int | None = None  # lowers the context window, never raises it
    profile: str | None = None  # the profile used when a request names none
    default: bool = False  # the model an empty ``model`` field means
    pinned: bool = False  # loaded at start and kept resident
    mmproj: str | None = None  # a vision projector: the model is a VLM


@dataclass(frozen=True)
class Target:
    """What a request addressed: a model and the profile it asked for (None: the model's)."""

    spec: ModelSpec
    profile: str | None = None

    @property
    def profile_name(self) -> str | None:
        """The profile in effect: the requested one, else the model's configured one."""
        return self.profile or self.spec.profile


@dataclass(frozen=True)
class ModelInfo:
    """One row of the model listing: a model id, or an alias with ``alias_of`` set."""

    id: str
    resident: bool
    pinned: bool
    speculative: bool
    vlm: bool
    profile: str | None
    default: bool
    context_length: int | None
    max_context_at_width_1: int | None = None
    alias_of: str | None = None


class Registry:
    """Configured models by id, their aliases and profiles, and one worker per loaded model.

    Args:
        specs: the models, in listing order.
        aliases: alias -> ``id`` or ``id@profile``; targets must resolve.
        profiles: the known profiles (built-in intents plus user profiles).
        decode_batch: the decode width of every worker (None: each model's from its
            capacity table, ``capacity.default_decode_batch``).
        queue_cap: most requests waiting per worker (None: the worker's default).
        prompt_cache_bytes: each worker's prompt cache bound (None: the worker's
            default; 0: off).
        governor: True for a governor on ``probe`` (floor ``governor_floor_bytes``, else
            ``default_floor`` of the machine's memory), False for a disabled one, or
            a ready Governor.
        overcommit: no capacity table judges requests (``GMLX_OVERCOMMIT=1``); the
            table is still built and reported in the metrics.
        probe: the free working set in bytes (default ``capacity.free_bytes``).
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
    ) -> None:
        self.specs: dict[str, ModelSpec] = {s.id: s for s in specs}
        self.warmup = warmup
        self.profiles = profiles or ProfileBook()
        self.decode_batch = decode_batch
        self.queue_cap = queue_cap
        self.prompt_cache_bytes = prompt_cache_bytes
        self.overcommit = overcommit
        self.probe: Callable[[], int] = probe or capacity.free_bytes
        if isinstance(governor, Governor):
            self.governor = governor
        else:
            floor = governor_floor_bytes or default_floor(_total_memory())
            self.governor = Governor(self.probe, floor_bytes=floor, enabled=governor)
        self.capacity: CapacityTable | None = None  # the boot table, of ``capacity_model``
        self.capacity_model: str | None = None
        self._geometry: dict[str, Geometry] = {}
        self._workers: dict[str, ModelWorker] = {}
        self._locks: dict[str, threading.Lock] = {i: threading.Lock() for i in self.specs}
        self.aliases: dict[str, Target] = {}
        for alias, ref in (aliases or {}).items():
            target = self._lookup(ref) or self._split(ref)
            if target is None:
                raise ValueError(f"alias {alias!r} points to {ref!r}, which is not a served model")
            self.aliases[alias] = target

    @property
    def ids(self) -> list[str]:
        return list(self.specs)

    # -- addressing -------------------------------------------------------------

    def address(self, model: str | None, profile: str | None = None) -> Target:
        """Resolve a request's ``model`` (and optional ``profile`` field) to a target.

        Raises ModelNotFoundError for an unknown id (``id@suffix`` whose suffix is no
        known profile is an unknown id), UnknownProfileError for an unknown ``profile``
        field, InvalidRequestError for an empty model that is ambiguous.
        """
        name = (model or "").strip()
        target = self._default() if not name else self._lookup(name) or self._split(name)
        if target is None:
            raise ModelNotFoundError(
                f"Model {name!r} is not served here; available models: "
                f"{', '.join(self.ids) or '(none)'}.",
                param="model",
                available_models=self.ids,
            )
        if profile:
            self.profiles.check(profile)
            target = replace(target, profile=profile)
        return target

    def _lookup(self, name: str) -> Target | None:
        if name in self.specs:
            return Target(self.specs[name])
        return self.aliases.get(name)

    def _split(self, name: str) -> Target | None:
        """``id@profile`` split on the last ``@``, only when the suffix names a known
        profile: otherwise ``name`` is one id (None here, so a 404 names all of it)."""
        head, sep, tail = name.rpartition("@")
        if not sep or not head or tail not in self.profiles:
            return None
        base = self._lookup(head)
        return replace(base, profile=tail) if base is not None else None

    def _default(self) -> Target:
        defaults = [s for s in self.specs.values() if s.default]
        if defaults:
            return Target(defaults[0])
        if len(self.specs) == 1:
            return Target(next(iter(self.specs.values())))
        raise InvalidRequestError(
            "The request names no model and this server has no single default; "
            f"name one of: {', '.join(self.ids) or '(none)'}.",
            param="model",
        )

    def profile(self, target: Target, loaded: LoadedModel) -> Profile:
        """The effective profile of a target on its loaded model (family base included)."""
        return self.profiles.resolve(target.profile_name, loaded.config.get("model_type"))

    # -- residency --------------------------------------------------------------

    def worker(self, model_id: str) -> ModelWorker:
        """The running worker of a model, loading it first if needed (blocks meanwhile).

        Concurrent callers for the same model wait for one load. Errors are
        ModelSourceError from the loader.
        """
        if (worker := self._workers.get(model_id)) is not None:
            return worker
        with self._locks[model_id]:
            if (worker := self._workers.get(model_id)) is not None:
                return worker
            from gmlx.engine.loading import load_model
            from gmlx.engine.worker import DEFAULT_PROMPT_CACHE_BYTES, ModelWorker

            spec = self.specs[model_id]
            loaded = load_model(spec.source, model_id=spec.id)
            if spec.max_kv_size:
                loaded.context_length = min(loaded.context_length, spec.max_kv_size)
            for note in loaded.notes:
                log.info("%s: %s", spec.id, note)
            table = self._measure(loaded)
            decode_batch = self.decode_batch
            if decode_batch is None:
                decode_batch = (
                    capacity.default_decode_batch(table, loaded.context_length)
                    if table is not None
                    else DEFAULT_DECODE_BATCH
                )
            cache_bytes = self.prompt_cache_bytes
            if cache_bytes is None:
                cache_bytes = DEFAULT_PROMPT_CACHE_BYTES
            worker = ModelWorker(
                loaded,
                decode_batch=decode_batch,
                queue_cap=self.queue_cap,
                prompt_cache_bytes=cache_bytes,
                governor=self.governor,
                buffer_cache_bytes=self._chunk_transient(loaded),
            )
            log.info(
                "loaded %s from %s (context %d, decode batch %d)",
                spec.id,
                spec.source,
                loaded.context_length,
                decode_batch,
            )
            if self.warmup:
                try:
                    seconds = worker.warm_up()
                except Exception:  # a model that fails here fails its first request the same way
                    log.warning("warm-up of %s failed", spec.id, exc_info=True)
                else:
                    log.info("warmed up %s: batch widths 1..%d in %.1f s", spec.id, decode_batch, seconds)
            self._workers[model_id] = worker
            return worker

    def _measure(self, loaded: LoadedModel) -> CapacityTable | None:
        """Probe a freshly loaded model's geometry and tabulate it against the memory
        free now; the first model's table is kept as the boot table. None when the
        model cannot be probed (its requests then run without a memory model).
        """
        from gmlx.engine.worker import default_prefill_step

        try:
            geom = capacity.probe_geometry(loaded)
            table = capacity.capacity_table(geom, self.free_bytes() or 0, default_prefill_step())
        except Exception:  # a model the probe does not understand still serves
            log.warning("cannot measure the memory geometry of %s", loaded.id, exc_info=True)
            return None
        self._geometry[loaded.id] = geom
        if self.capacity is None:
            self.capacity, self.capacity_model = table, loaded.id
            log.info(
                "capacity (%s): budget %s, max context %s by width",
                loaded.id,
                capacity.human(table.budget_bytes),
                ", ".join(f"{w}: {c}" for w, c in table.max_ctx.items()),
            )
        return table

    def _chunk_transient(self, loaded: LoadedModel) -> int | None:
        """The transient of one full prefill chunk at the model's context: what the
        capacity model sets aside for prefill, and so what its worker may keep of
        MLX's buffer cache between chunks (None when the model was not measured)."""
        from gmlx.engine.worker import default_prefill_step

        geom = self._geometry.get(loaded.id)
        if geom is None:
            return None
        return capacity.prefill_transient(geom, default_prefill_step(), loaded.context_length)

    def geometry(self, model_id: str) -> Geometry | None:
        """A resident model's measured geometry (None: not loaded, or not measurable)."""
        return self._geometry.get(model_id)

    def free_bytes(self) -> int | None:
        """The memory requests may still use now (None when the probe fails): the free
        working set less the governor's reserve, twice its floor. Whatever fits this
        keeps the band at yellow or better, so a plan that says it fits is never shed.
        """
        try:
            free = int(self.probe())
        except Exception:
            log.warning("the free-memory probe failed", exc_info=True)
            return None
        reserve = 2 * self.governor.floor_bytes if self.governor.enabled else 0
        return max(0, free - reserve)

    def running_kv_bytes(self) -> int:
        """KV bytes the running requests of every worker hold now: what finishing
        them would give back (the drained working set is free memory plus this)."""
        total = 0
        for worker in self.workers():
            geom = self._geometry.get(worker.loaded.id)
            if geom is None:
                continue
            for row in worker.rows():
                if row["state"] in ("prefill", "decode"):
                    total += capacity.kv_bytes(geom, row["prompt_tokens"] + row["generated"])
        return total

    def table_for_requests(self) -> CapacityTable | None:
        """The boot table when it may judge requests (None under overcommit)."""
        return None if self.overcommit else self.capacity

    def preload(self, model_ids: Iterable[str] | None = None) -> None:
        """Load the named models now (default: the pinned ones)."""
        ids = (
            list(model_ids)
            if model_ids is not None
            else [s.id for s in self.specs.values() if s.pinned]
        )
        for model_id in ids:
            self.worker(model_id)

    def resident_worker(self, model_id: str) -> ModelWorker | None:
        """The worker of a model if it is loaded; never loads it."""
        return self._workers.get(model_id)

    def workers(self) -> list[ModelWorker]:
        """The workers of the loaded models."""
        return list(self._workers.values())

    def resident(self, model_id: str) -> bool:
        return model_id in self._workers

    def running(self, model_id: str) -> ModelWorker | None:
        """The worker of a resident model, without waiting (None: not loaded)."""
        return self._workers.get(model_id)

    def listing(self) -> list[ModelInfo]:
        """Every model id, then every alias, with their markers."""
        rows = [self._info(spec.id, Target(spec)) for spec in self.specs.values()]
        rows += [self._info(alias, t, alias_of=t.spec.id) for alias, t in self.aliases.items()]
        return rows

    def _info(self, name: str, target: Target, alias_of: str | None = None) -> ModelInfo:
        spec = target.spec
        worker = self._workers.get(spec.id)
        context = worker.loaded.context_length if worker is not None else spec.max_kv_size
        table = self.table_for_requests()
        at_width_1 = table.max_ctx_at(1) if table and spec.id == self.capacity_model else None
        return ModelInfo(
            id=name,
            resident=worker is not None,
            pinned=spec.pinned,
            speculative=False,
            vlm=spec.mmproj is not None,
            profile=target.profile_name,
            default=spec.default and alias_of is None,
            context_length=context,
            max_context_at_width_1=at_width_1,
            alias_of=alias_of,
        )

    def close(self) -> None:
        """Stop every worker (their requests finish as cancelled)."""
        for worker in list(self._workers.values()):
            worker.close()
        self._workers.clear()
