"""The memory a registry's requests may still use, and what its running requests hold.

Admission (``gmlx.engine.admission``) asks the registry for both: a request fits when
its need is below the usable free memory, and would fit once the running requests
drain when it is below that plus the KV they hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gmlx.engine import capacity

if TYPE_CHECKING:
    from gmlx.engine.governor import Governor
    from gmlx.engine.residents import Resident

log = logging.getLogger("gmlx.engine")


def total_memory() -> int:
    """The machine's physical memory in bytes."""
    import psutil

    return int(psutil.virtual_memory().total)


def usable_bytes(probe: Callable[[], int], governor: Governor) -> int | None:
    """The memory requests may still use now (None when the probe fails): the free
    working set less the governor's reserve, twice its floor. Whatever fits this
    keeps the band at yellow or better, so a plan that says it fits is never shed.
    """
    try:
        free = int(probe())
    except Exception:
        log.warning("the free-memory probe failed", exc_info=True)
        return None
    reserve = 2 * governor.floor_bytes if governor.enabled else 0
    return max(0, free - reserve)


def running_kv_bytes(entries: Iterable[Resident]) -> int:
    """KV bytes the running requests of the resident models hold now: what finishing
    them would give back (the drained working set is free memory plus this)."""
    total = 0
    for entry in entries:
        if entry.geometry is None:
            continue
        for row in entry.worker.rows():
            if row["state"] in ("prefill", "decode"):
                total += capacity.kv_bytes(
                    entry.geometry, row["prompt_tokens"] + row["generated"]
                )
    return total
