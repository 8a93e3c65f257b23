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


def one_row_shape(key: str, shapes: Sequence[tuple[int, ...]], calls: Callable[[tuple[int, ...]], list[Any]],
                  agrees: Callable[[Any], bool], k: int, bits: int, dtype: Any,
                  reps: int = 32) -> tuple[tuple[int, ...], str]:
    """The launch shape (of ``shapes``, the first the default) a step kernel of
    ``bits``-bit codes takes at one row, and what was timed, for the log: from an earlier
    load on this machine (``key``, kept apart by what its shapes run: :func:`qgemv_q8.key`),
    else each shape's ``calls(shape)`` (the kernel bound to
    each of its layers, as the step binds it) timed in a chain over the layers in turn
    (:func:`timing.chain_time`: each call's input the last one's output, the weights
    read from memory as a step reads them; a call's time the slope between chains of
    ``reps`` and four times as many, :func:`timing.per_call`), where its first call
    ``agrees``; the first shape timed again last (a GPU still speeding up favours what it
    meets later); then the close contenders again, in turn (:func:`timing.runoff`). A
    shape that does not build or launch is no shape. ``GMLX_STEP_SHAPES=device`` times
    each chain behind a lead product
    (:func:`timing.device_chain_time`: the device's part alone, where a small kernel's
    chain is the host's), its choices kept under their own key; not yet measured served.
    ``GMLX_STEP_SHAPES=0`` takes the first shape, untimed (the default
    until the 12-06 evening lease: the timed shapes served one stream 5% faster, 302-310
    against 288 tok/s on an H100, the gate-up-swiglu taking 4x2x1 at 43.7 against 46.9 us)."""
    import itertools

    import mlx.core as mx

    from gmlx.engine.kernels import qgemv_prepared, qgemv_q8
    from gmlx.engine.kernels.timing import chain_call_time, device_chain_time, fed, runoff
    from gmlx.engine.kernels.tuning import Tuning

    mode = os.environ.get("GMLX_STEP_SHAPES", "1")
    if mode == "0":
        return shapes[0], "the first shape (GMLX_STEP_SHAPES=0)"
    device = mode == "device"
    if device:  # the device's part alone, kept apart from the chain's choices
        key = f"{key}:device"
    if any(len(shape) > 5 and shape[5] > 1 for shape in shapes):  # K split (GMLX_SPLIT_K): kept apart
        key = f"{key}:split"
    if any(len(shape) > 6 and shape[6] > 1 for shape in shapes):  # streamed (GMLX_ASYNC=1): kept apart
        key = f"{key}:async"
    if qgemv_prepared.prepared():  # the normed products' x made once a block (GMLX_PREPARED=1): kept apart
        key = f"{key}:prepared"
    # x rounded to bytes (a 6-bit product's with GMLX_Q8X=all, the default), the deeper rounded shapes: kept apart
    key += qgemv_q8.key(bits)
    tuning = Tuning()
    known = tuning.layer(key)
    if known and 1 in known:
        return known[1][1], "from an earlier load"
    x = (mx.random.normal((1, 1, k), key=mx.random.key(k)) * 0.5).astype(dtype)
    times: dict[tuple[int, ...], float] = {}
    chains: dict[tuple[int, ...], tuple[Callable[[Any], Any], int]] = {}  # a shape's chain, its layers

    def timed(shape: tuple[int, ...]) -> None:
        try:
            if shape not in chains:
                bound = calls(shape)
                if not agrees(bound[0]):
                    return
                turn = itertools.count()

                def chain(y: Any, bound: list[Any] = bound, turn: Any = turn) -> Any:
                    out = bound[next(turn) % len(bound)](y)
                    return fed(out[0] if isinstance(out, tuple) else out, y)

                chains[shape] = (chain, len(bound))
            chain, layers = chains[shape]
            calls_timed = max(reps, layers)
            if device:
                took = device_chain_time(chain, x, calls_timed) / calls_timed
            else:  # the chain's slope: its own cost taken out (:func:`timing.per_call`)
                took = chain_call_time(chain, x, calls_timed)
        except (TypeError, ValueError, RuntimeError) as error:
            log.warning("cuda: a launch shape %s is not used: %s", shape, str(error).splitlines()[0][:200])
            return
        times[shape] = min(times.get(shape, took), took)

    for shape in [*shapes, shapes[0]]:
        timed(shape)
    for shape in runoff(times):
        timed(shape)
    best = min(times, key=lambda s: times[s]) if times else shapes[0]
    tuning.set_layer(key, {1: ("gemv", best)})
    tuning.save()
    said = ", ".join(f"{'x'.join(map(str, s))}: {t * 1e6:.1f}" for s, t in times.items()) + " us"
    return best, said + (", the device's part" if device else "")


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


def tried_far(run: Callable[[Any], Any], layer: Any, seed: int) -> tuple[Any, Any] | None:
    """``(h, run(h))`` for one random row as wide as quantized ``layer``'s input and far
    from unit RMS (:func:`timing.far_row`), evaluated; None when the kernel would not
    build or run here (a folded norm's check)."""
    import mlx.core as mx

    from gmlx.engine.kernels.timing import far_row

    h = far_row(layer.weight.shape[1] * 32 // layer.bits, layer.scales.dtype, seed)
    try:
        got = run(h)
        mx.eval(got)
    except (TypeError, ValueError, RuntimeError):
        return None
    return h, got


def speedups(kept: dict[int, float]) -> str:
    """``kept`` for a load note."""
    return ", ".join(f"{b}: {x:.2f}x" for b, x in sorted(kept.items())) or "none faster"


def fold_norms(model: Any, norm_name: str, part_name: str, marker: str, attr: str,
               bind: Callable[[Any, Any, Any], list[tuple[str, Callable[[Any], Any]]]],
               check: Callable[[Any, Any, Callable[[Any], Any]], bool], what: str) -> str | None:
    """The load's part of a norm folded into the kernel after it (:mod:`glu_cuda`'s and
    :mod:`qkv_cuda`'s ``fold_norms``): for each block whose ``norm_name`` is an RMSNorm
    and whose ``part_name`` layer carries ``marker``, ``bind(norm, part, weight)`` (the
    norm's weight in the layer's type, evaluated here, outside any trace) gives the folded
    kernels it may take, each with its shape's key, the preferred first (none where it
    cannot take one); each key's first is ``check``-ed against MLX's norm and products,
    and the layer gets the first that agrees as ``attr``, with its input's type. Returns
    the log line (None: no block)."""
    import mlx.core as mx
    from mlx import nn

    blocks = [(m[norm_name], m[part_name]) for _, m in model.named_modules()
              if isinstance(m.get(norm_name), nn.RMSNorm) and vars(type(m.get(part_name))).get(marker)]
    verdicts: dict[str, bool] = {}
    folded = 0
    for norm, part in blocks:
        object.__setattr__(part, attr, None)
        dtype = next((layer.scales.dtype for _, layer in part.named_modules()
                      if isinstance(layer, nn.QuantizedLinear)), None)
        if dtype is None:  # nothing quantized to fold it into
            continue
        weight = norm.weight.astype(dtype)
        mx.eval(weight)
        for key, run in bind(norm, part, weight):
            if key not in verdicts:
                verdicts[key] = check(part, norm, run)
                log.log(logging.INFO if verdicts[key] else logging.WARNING,
                        "cuda: the norm folded into %s of %s: %s", what, key,
                        "taken" if verdicts[key] else "disagrees with MLX's norm and products, not taken")
            if verdicts[key]:
                object.__setattr__(part, attr, (run, dtype))
                folded += 1
                break
    return (f"cuda: the norm before {what} folded into their kernel at one stream in {folded} of {len(blocks)} "
            f"block(s)") if blocks else None


def folded(part: Any, attr: str, x: Any) -> Callable[[Any], Any] | None:
    """The kernel :func:`fold_norms` gave ``part`` as ``attr``, where ``x`` is one row of
    its input's type; else None."""
    kept = getattr(part, attr, None)
    return kept[0] if kept is not None and x.size == x.shape[-1] and x.dtype == kept[1] else None
