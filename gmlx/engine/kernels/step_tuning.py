"""Whether a kernel that stands in for several of a decode step's operations makes whole
steps faster, decided at load for each bucket of streams and kept with the tuner's other
decisions (:mod:`tuning`), so a machine decides once.

The kernel must first give what the operations it replaces give (``agrees``); then, for
each bucket of 1, 2, 4 and 8 streams, a whole decode step is timed without it and with it
(``fast_linear.step_time``: pipelined, as the worker runs steps), and the bucket takes it
only 2% faster or more. :mod:`glu_cuda` and :mod:`qkv_cuda` decide this way."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

BUCKETS = (1, 2, 4, 8)
MAX_ROWS = BUCKETS[-1]


def bucket(rows: int) -> int:
    """The bucket (1, 2, 4, 8) a step of ``rows`` streams takes its kernel from."""
    return 1 if rows == 1 else 1 << (rows - 1).bit_length()


def decide(model: Any, key: str, agrees: Callable[[], bool], use: Callable[[Iterable[int]], None]) -> dict[int, float]:
    """The buckets where ``use``-ing the kernel made ``model``'s whole step faster, with
    the speed-up, from an earlier load on this machine (``key``) or timed now; the
    kernel is left in use at those. ``agrees`` false: none, nothing timed."""
    from gmlx.engine.kernels import fast_linear
    from gmlx.engine.kernels.tuning import Tuning

    tuning = Tuning()
    kept = tuning.confirmed(key)
    if kept is None:
        kept = {}
        if agrees():
            for b in BUCKETS:
                try:
                    use(())
                    without = fast_linear.step_time(model, b)
                    use((b,))
                    with_kernel = fast_linear.step_time(model, b)
                except (TypeError, ValueError, RuntimeError):  # a model this cannot step
                    continue
                if with_kernel < 0.98 * without:
                    kept[b] = without / with_kernel
        tuning.set_confirmed(key, kept)
        tuning.save()
    use(kept)
    return kept


def speedups(kept: dict[int, float]) -> str:
    """``kept`` for a load note."""
    return ", ".join(f"{b}: {x:.2f}x" for b, x in sorted(kept.items())) or "none faster"
