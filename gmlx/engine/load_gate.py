"""The load gate: a model loads only when its price fits beside the resident ones.

The price (``sizing``: weights plus KV for the decode width) must fit the free memory
less the governor's floor. When it does not, idle resident models unload for it,
least recently used first (kept ones last); a model that streams (requests in flight
or waiting) or is pinned never does. When that is not enough, the gate waits up to
``wait_s`` for memory a recent unload is still returning (or for a model used a
moment ago to turn idle), then refuses with ModelLoadDeferredError: a 503 with the
gate's numbers and ``Retry-After``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gmlx.engine.addressing import ModelSpec
from gmlx.engine.capacity import human
from gmlx.engine.errors import ModelLoadDeferredError
from gmlx.engine.residents import Resident, Residents, eviction_order
from gmlx.engine.scheduling import DEFAULT_REQUEST_S, RETRY_AFTER_RANGE, retry_after_s
from gmlx.engine.sizing import SourceSize

log = logging.getLogger("gmlx.engine")

POLL_S = 0.05  # how often the gate measures while it waits for memory


class LoadGate:
    """Makes room for a model among ``residents`` (see the module docstring).

    Args:
        residents: the resident models, which the gate unloads from.
        wait_s: how long a load waits for memory still on its way back.
    """

    def __init__(self, residents: Residents, wait_s: float) -> None:
        self.residents = residents
        self.wait_s = wait_s

    def admit(
        self,
        spec: ModelSpec,
        size: SourceSize,
        *,
        width: int,
        probe: Callable[[], int],
        floor: int,
    ) -> None:
        """Return once ``spec``'s model, priced ``size`` for ``width`` streams, fits
        ``probe()`` less ``floor``, unloading idle models as needed. Raises
        ModelLoadDeferredError when it cannot fit beside the pinned or busy ones; a
        probe that fails lets the model through (logged)."""
        need = size.need_bytes(width, spec.max_kv_size)
        credit = 0  # bytes unloaded here that the probe may not show as free yet
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                free = int(probe())
            except Exception:
                log.warning(
                    "the free-memory probe failed; %s loads ungated", spec.id, exc_info=True
                )
                return
            if free - floor >= need:
                return
            now = self.residents.clock()
            victims, blockers = eviction_order(self.residents.entries(), now)
            soon_idle = any(not b.spec.pinned and not b.busy for b in blockers)
            recent = self.residents.recently_unloaded(now)
            wait = (recent or soon_idle) and time.monotonic() < deadline
            # Unload one more only while what was unloaded here would not cover the
            # need once the system shows it; otherwise give that memory time to come.
            if victims and (free - floor + credit < need or not wait):
                victim = victims[0]
                if self.residents.take_for_room(victim):
                    credit += victim.worker.weight_bytes
                    self.residents.close([victim], f"to make room for {spec.id}")
                del victim  # its model's arrays go now, not at the next pass
                continue
            if wait:
                time.sleep(POLL_S)
                continue
            raise deferred(
                spec,
                need=need,
                weights=size.weight_bytes,
                kv=size.kv_bytes(width, spec.max_kv_size),
                width=width,
                free=free,
                floor=floor,
                blockers=blockers,
            )


def blocker_note(entry: Resident) -> str:
    """Why a resident model cannot unload for another, in a word or two."""
    if entry.spec.pinned:
        return "pinned"
    if entry.busy:
        return "busy"
    return "just used"


def deferred(
    spec: ModelSpec,
    *,
    need: int,
    weights: int,
    kv: int,
    width: int,
    free: int,
    floor: int,
    blockers: list[Resident],
) -> ModelLoadDeferredError:
    """The 503 for a model that cannot load beside the blocking ones: the gate's
    numbers (human-readable and in bytes), and ``Retry-After`` from when the soonest
    busy model may be idle (the range's top when only pinned models block)."""
    soonest = [
        b.worker.queue_eta_s() + (b.worker.stats.mean_request_s() or DEFAULT_REQUEST_S)
        for b in blockers
        if not b.spec.pinned
    ]
    retry = retry_after_s(min(soonest)) if soonest else RETRY_AFTER_RANGE[1]
    held = ", ".join(f"{b.spec.id} ({blocker_note(b)})" for b in blockers) or "none"
    return ModelLoadDeferredError(
        f"Model {spec.id!r} cannot load now: it needs {human(need)} ({need} bytes: weights "
        f"{human(weights)} + KV {human(kv)} for {width} stream(s)), but {human(free)} ({free} "
        f"bytes) is free and the governor keeps a floor of {human(floor)} ({floor} bytes); "
        f"resident models that cannot unload for it: {held}. Retry in {retry} s.",
        param="model",
        headers={"Retry-After": str(retry)},
        need_bytes=need,
        free_bytes=free,
        floor_bytes=floor,
    )
