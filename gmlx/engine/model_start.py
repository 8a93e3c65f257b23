"""Starting a model: load it, measure it, and put it on its own worker.

:class:`Loads` makes concurrent callers for one model wait for one load;
:func:`start_model` is what the registry does once the load gate has let a model
through. The model's
geometry is measured on one token and tabulated against the memory free then (its
capacity table, which becomes the boot table if there is none yet), its decode width
chosen, and with ``warmup`` its batch shapes compiled before the first request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gmlx.engine import capacity
from gmlx.engine.addressing import ModelSpec
from gmlx.engine.governor import Governor
from gmlx.engine.residents import Resident
from gmlx.engine.scheduling import DEFAULT_DECODE_BATCH, default_prefill_step

if TYPE_CHECKING:
    from gmlx.engine.worker import ModelWorker

log = logging.getLogger("gmlx.engine")


class Loads:
    """The loads in progress, one per model id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, Future[ModelWorker]] = {}

    def ids(self) -> list[str]:
        """The models loading now."""
        with self._lock:
            return list(self._pending)

    def run(
        self,
        model_id: str,
        resident: Callable[[], ModelWorker | None],
        load: Callable[[], ModelWorker],
    ) -> tuple[ModelWorker, bool]:
        """The model's worker, and whether this call loaded it: ``resident()`` when it
        gives one, else the result of the load in progress, else ``load()`` run here.
        A failed load raises its error to every caller that waited for it, and the
        next call loads again."""
        future: Future[ModelWorker] = Future()
        with self._lock:  # a load registers its worker before it leaves ``_pending``
            if (worker := resident()) is not None:
                return worker, False
            pending = self._pending.setdefault(model_id, future)
        if pending is not future:
            return pending.result(), False
        try:
            worker = load()
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._pending[model_id]
        future.set_result(worker)
        return worker, True


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of a registry shares (see ``Registry``'s arguments)."""

    decode_batch: int | None
    queue_cap: int | None
    prompt_cache_bytes: int | None
    governor: Governor
    warmup: bool


def start_model(
    spec: ModelSpec,
    settings: WorkerSettings,
    *,
    free_bytes: Callable[[], int | None],
    now: float,
) -> Resident:
    """:func:`_start_model`, its phases reported as ``spec.id``'s (``loading.progress``)."""
    from gmlx.engine.loading import progress

    with progress.loading(spec.id):
        return _start_model(spec, settings, free_bytes=free_bytes, now=now)


def _start_model(
    spec: ModelSpec,
    settings: WorkerSettings,
    *,
    free_bytes: Callable[[], int | None],
    now: float,
) -> Resident:
    """Load ``spec``'s model and start its worker; the entry is not registered yet.

    Args:
        free_bytes: the memory requests may use now, for the capacity table.
        now: the registry's clock, the new model's last use.

    Raises ModelSourceError (and subclasses) from the loader.
    """
    from gmlx.engine.kernels import prepare_layers
    from gmlx.engine.loading import load_model
    from gmlx.engine.loading.cpu_float import dequantize_for_cpu
    from gmlx.engine.worker import DEFAULT_PROMPT_CACHE_BYTES, ModelWorker

    loaded = load_model(spec.source, model_id=spec.id, mmproj=spec.mmproj)
    if spec.max_kv_size:
        loaded.context_length = min(loaded.context_length, spec.max_kv_size)
    if (note := dequantize_for_cpu(loaded.model, free_bytes())) is not None:
        loaded.notes.append(note)
    loaded.notes.extend(prepare_layers(loaded.model))
    for note in loaded.notes:
        log.info("%s: %s", spec.id, note)
    speculation = None
    if spec.draft is not None:  # the drafter loads with its model: a bad one fails the load
        from gmlx.engine.speculative import load_speculation

        speculation = load_speculation(spec.draft, loaded)
    # Verification drops each stream's rejected drafts from its KV: a scheme with a
    # `start` offset cannot, so a speculative model with one runs full-precision KV
    # (its listing says `dropped`); a tail keeps `draft_tokens + 1` positions more.
    kv_quant = spec.kv_quant
    if kv_quant is not None and speculation is not None:
        kv_quant = kv_quant.for_drafts(speculation.spec.draft_tokens)
        if kv_quant is None:
            log.warning("%s: kv_quant is not applied: the model decodes speculatively, and a "
                        "scheme with a start offset cannot drop a round's rejected drafts", spec.id)
    chunk = default_prefill_step()
    geom: capacity.Geometry | None = None
    table: capacity.CapacityTable | None = None
    try:
        measured = capacity.probe_geometry(loaded, kv_quant)
        if speculation is not None and speculation.draft is not None:  # its weights and KV too
            measured = capacity.with_drafter(measured, capacity.probe_geometry(speculation.draft))
        table = capacity.capacity_table(measured, free_bytes() or 0, chunk)
        geom = measured
    except Exception:  # a model the probe does not understand still serves
        log.warning("cannot measure the memory geometry of %s", spec.id, exc_info=True)
    decode_batch = settings.decode_batch
    if decode_batch is None:
        decode_batch = (
            capacity.default_decode_batch(table, loaded.context_length)
            if table is not None
            else DEFAULT_DECODE_BATCH
        )
    cache_bytes = settings.prompt_cache_bytes
    worker = ModelWorker(
        loaded,
        decode_batch=decode_batch,
        queue_cap=settings.queue_cap,
        prompt_cache_bytes=DEFAULT_PROMPT_CACHE_BYTES if cache_bytes is None else cache_bytes,
        governor=settings.governor,
        kv_quant=kv_quant,
        speculation=speculation,
        # The transient of one full prefill chunk at the model's context: what the
        # capacity model sets aside for prefill, so what the worker may keep of MLX's
        # buffer cache between chunks.
        buffer_cache_bytes=(
            capacity.prefill_transient(geom, chunk, loaded.context_length) if geom else None
        ),
    )
    log.info(
        "loaded %s from %s (context %d, decode batch %d)",
        spec.id,
        spec.source,
        loaded.context_length,
        decode_batch,
    )
    entry = Resident(spec=spec, worker=worker, last_used=now, geometry=geom, table=table)
    if settings.warmup:
        warm_up(entry)
    return entry


def warm_up(entry: Resident) -> float | None:
    """Compile the entry's decode shapes (``ModelWorker.warm_up``); returns the seconds
    it took, or None when it failed (a model that fails here fails its first request
    the same way, which reports it properly)."""
    from gmlx.engine.loading import progress

    progress.phase("compile")
    try:
        seconds = entry.worker.warm_up()
    except Exception:
        log.warning("warm-up of %s failed", entry.spec.id, exc_info=True)
        return None
    entry.warmed = True
    log.info(
        "warmed up %s: batch widths 1..%d and the prefill shapes in %.1f s",
        entry.spec.id,
        entry.worker.decode_batch,
        seconds,
    )
    return seconds
