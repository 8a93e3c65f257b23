"""Whether a kernel that stands in for several of a decode step's operations makes whole
steps faster, decided at load for each bucket of streams and kept with the tuner's other
decisions (:mod:`tuning`), so a machine decides once.

The kernel must first give what the operations it replaces give (``agrees``); then, for
each bucket of 1, 2, 4, ... 64 streams, a whole decode step is timed without it and with it,
twice each in the order without-with-with-without (``timing.step_times``: pipelined,
as the worker runs steps), and the bucket takes it only 2% faster or more. :mod:`glu_cuda` and :mod:`qkv_cuda` decide this way."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_ROWS = BUCKETS[-1]


def bucket(rows: int) -> int:
    """The bucket (1, 2, 4, 8, ...: a power of two) a step of ``rows`` streams takes its
    kernel from."""
    return 1 if rows == 1 else 1 << (rows - 1).bit_length()


def tensor_cores(layer: Any, rows: int) -> bool:
    """Whether a step kernel standing in for ``layer``'s product (and its neighbours')
    takes the tensor-core source at the bucket ``rows``: past the CUDA-core kernels'
    buckets (``fast_linear.GEMV_ROWS``), or where the load's tuner gave ``layer`` itself
    the tensor-core kernel there (its ``paths``)."""
    from gmlx.engine.kernels.fast_linear import GEMV_ROWS, KERNEL

    chosen = (getattr(layer, "paths", None) or {}).get(rows)
    return rows > GEMV_ROWS or (chosen is not None and chosen[0] == KERNEL)


def tune(model: Any, env: str, what: str, members: Sequence[Any], keys: Sequence[str],
         agrees: Callable[[Any], bool], use: Callable[[Iterable[int]], None]) -> str:
    """A step kernel's load decision and its load note: with ``env=1`` every bucket
    untimed, else :func:`decide`, its agreement checked on one member (of ``members``)
    per distinct layer key (``keys``, one each) and its decision kept under all of them."""
    from gmlx.engine.kernels import traces
    from gmlx.engine.kernels.tuning import model_key

    if os.environ.get(env) == "1":
        use(BUCKETS)
        return f"cuda: {what} at every step of 1-{MAX_ROWS} streams"
    one_each = {k: m for k, m in zip(keys, members, strict=True)}.values()
    key = f"{model_key(keys, form=traces.step_form(model))}:{env}"
    kept = decide(model, key, lambda: all(agrees(m) for m in one_each), use)
    return f"cuda: {what}; whole-step speed-up by rows: {speedups(kept)}"


def decide(model: Any, key: str, agrees: Callable[[], bool], use: Callable[[Iterable[int]], None]) -> dict[int, float]:
    """The buckets where ``use``-ing the kernel made ``model``'s whole step faster, with
    the speed-up, from an earlier load on this machine (``key``) or timed now; the
    kernel is left in use at those. ``agrees`` false: none, nothing timed."""
    from gmlx.engine.kernels import timing
    from gmlx.engine.kernels.tuning import Tuning

    tuning = Tuning()
    kept = tuning.confirmed(key)
    if kept is None:
        kept = {}
        if agrees():
            for b in BUCKETS:
                started = time.perf_counter()
                try:
                    without, with_kernel = timing.step_times(
                        model, b, lambda taken, b=b: use((b,) if taken else ()))
                except (TypeError, ValueError, RuntimeError):  # a model this cannot step
                    continue
                log.info("cuda: %s at %d rows: whole step %.2fx (%.1f s)", key.rsplit(":", 1)[-1], b,
                         without / with_kernel, time.perf_counter() - started)
                if with_kernel < 0.98 * without:
                    kept[b] = without / with_kernel
        tuning.set_confirmed(key, kept)
        tuning.save()
    use(kept)
    return kept


def tried(run: Callable[[Any, int], Any], k: int, dtype: Any, rows: tuple[int, ...] = (1, 3)) -> list | None:
    """``(x, rows, run(x, rows))`` for random inputs of ``rows`` rows, ``k`` wide, each
    evaluated; None when the kernel would not build or run here (what ``agrees`` checks
    against MLX's own operations)."""
    import mlx.core as mx

    results = []
    for n in rows:
        x = (mx.random.normal((n, 1, k), key=mx.random.key(n)) * 0.5).astype(dtype)
        try:
            got = run(x, n)
            mx.eval(got)
        except (TypeError, ValueError, RuntimeError):
            return None
        results.append((x, n, got))
    return results


def speedups(kept: dict[int, float]) -> str:
    """``kept`` for a load note."""
    return ", ".join(f"{b}: {x:.2f}x" for b, x in sorted(kept.items())) or "none faster"
