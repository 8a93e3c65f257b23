"""What a load's tuners measure with: whole decode steps pipelined as the worker runs them (:func:`step_time`, :func:`step_times`),
calls in a chain, each one's input the last one's output (:func:`chain_time`, :func:`chained`, :func:`fed`; the device's
part alone: :func:`device_chain_time`), and the agreement every path must show
with a float32 product before it is timed (:func:`agrees`). Used by :mod:`fast_linear`
(the products' paths) and :mod:`step_tuning` (the step kernels)."""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from mlx import nn

log = logging.getLogger(__name__)


def cycling(product: Callable[..., Any], x: Any, weights: list[tuple[Any, ...]]) -> Callable[[], Any]:
    """``product(x, *w)`` over each of ``weights`` in turn, one a call."""
    turn = itertools.count()
    return lambda: product(x, *weights[next(turn) % len(weights)])


def chained(product: Callable[..., Any], weights: list[tuple[Any, ...]]) -> Callable[[Any], Any]:
    """``product(x, *w)`` over each of ``weights`` in turn, one a call, for
    :func:`chain_time`: each call's output made the next call's input (:func:`fed`)."""
    turn = itertools.count()
    return lambda x: fed(product(x, *weights[next(turn) % len(weights)]), x)


def fed(out: Any, x: Any) -> Any:
    """``out`` as the next input of a chain that started from ``x``: its elements from the
    first on, shaped as ``x`` (a view where ``out`` has as many or more, no copy, so only
    the calls' own costs differ; repeated where it has fewer)."""
    import mlx.core as mx

    flat = out.reshape(-1)
    if flat.size < x.size:
        flat = mx.concatenate([flat] * -(-x.size // flat.size))
    return flat[:x.size].reshape(x.shape)


def step_times(model: nn.Module, rows: int, use: Callable[[bool], None]) -> tuple[float, float]:
    """Seconds per decode step of ``rows`` streams without and with what ``use(True)``
    puts in place (``use(False)`` takes it out), each timed twice (:func:`step_time`) in
    the order without, with, with, without, so a machine whose speed drifts while it is
    timed (clocks rising, caches filling) favours neither; left with it in place. After
    each switch the compiled blocks trace again (:mod:`compiled_blocks`: a trace keeps the
    products' paths it met)."""
    from gmlx.engine.kernels import traces

    times = {False: 0.0, True: 0.0}
    for taken in (False, True, True, False):
        use(taken)
        traces.retrace(model)
        times[taken] += step_time(model, rows)
    use(True)
    traces.retrace(model)
    return times[False] / 2, times[True] / 2


def step_time(model: nn.Module, rows: int, context: int = 32, steps: int = 12) -> float:
    """Seconds per decode step of ``rows`` streams after a ``context``-token prompt, run
    as the worker runs them: each step's tokens (the greedy pick) feed the next, which is
    built and handed to the GPU before the last one's tokens are read, so a step costs
    the larger of its host time and its GPU time. (Waiting for each step would add the
    two: a path that saves the GPU time it costs the host would time faster there and
    serve slower; on the H200 the one-row kernels did at one stream.) Over the batch
    cache the worker's generator holds (``prompt_cache.batch_cache``), so the blocks run
    as served, compiled where they are. Past 64 rows, per prefill of one ``rows``-token
    prompt (the products a prefill chunk makes)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.prompt_cache import batch_cache

    if rows > 64:
        prompt = mx.zeros((1, rows), mx.int32)
        mx.eval(model(prompt))
        start = time.perf_counter()
        for _ in range(2):
            mx.eval(model(prompt))
        return (time.perf_counter() - start) / 2
    cache = batch_cache(model, rows) or make_prompt_cache(model)

    def step(tokens: Any) -> Any:
        return mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1, keepdims=True)

    mx.eval(model(mx.zeros((rows, context), mx.int32), cache=cache))
    pending = step(mx.zeros((rows, 1), mx.int32))
    mx.async_eval(pending)
    start = 0.0
    for i in range(steps + 2):  # two untimed: the first steps compile
        if i == 2:
            start = time.perf_counter()
        following = step(pending)
        mx.async_eval(following)
        pending.tolist()  # the worker reads each step's tokens
        pending = following
    pending.tolist()
    return (time.perf_counter() - start) / steps


# what :func:`agrees` allows beyond twice MLX's error, a share of the largest value
TOLERANCE = 1e-3


def runs_and_agrees(fn: Callable[[], Any], want: Any, exact: Any, tolerance: float = TOLERANCE) -> bool:
    """Whether a path runs here and agrees (a kernel that does not compile is no path;
    ``tolerance`` as :func:`agrees` takes it)."""
    try:
        return agrees(fn(), want, exact, tolerance)
    except (RuntimeError, ValueError) as e:  # NVRTC's compile error, a launch MLX refused, a layout a shape refuses
        log.warning("cuda: a decode-sized path is not used: %s", str(e).splitlines()[0][:200])
        return False


def agrees(got: Any, want: Any, exact: Any, tolerance: float = TOLERANCE) -> bool:
    """Whether the kernel's ``got`` is as close to the float32 product ``exact`` as MLX's
    own quantized matmul ``want`` is (within twice its error, plus ``tolerance`` of the
    largest value: by default 0.1%, both accumulate in their own order and round to
    float16; a one-row product that rounds x to bytes is allowed
    :func:`qgemv_q8.tolerance`)."""
    import mlx.core as mx

    got, want, exact = (a.astype(mx.float32) for a in (got, want, exact))
    err_kernel = mx.abs(got - exact).max()
    err_mlx = mx.abs(want - exact).max()
    return (err_kernel <= 2 * err_mlx + tolerance * mx.abs(exact).max()).item()


def exact_norm(x: Any, norm: Any) -> Any:
    """``norm`` (an RMSNorm) of ``x`` in float32: what a folded norm is held to."""
    import mlx.core as mx

    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + norm.eps) * norm.weight.astype(mx.float32)


def far_row(k: int, dtype: Any, seed: int) -> Any:
    """One random row of ``k`` values, far from unit RMS (a folded norm's scale shows)."""
    import mlx.core as mx

    return (mx.random.normal((1, 1, k), key=mx.random.key(seed)) * 3 + 0.5).astype(dtype)


def exact_product(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int) -> Any:
    """``x @ dequantize(w).T`` in float32: the reference every product is held to. The
    weights are dequantized from float32 scales and biases, so each is ``s * q + b``
    exactly (dequantized in bfloat16 scales' own type, they would be rounded to bfloat16
    first, a reference as far off as the kernels it judges)."""
    import mlx.core as mx

    w = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return x.astype(mx.float32) @ w.T


def chain_time(call: Callable[[Any], Any], x: Any, reps: int) -> float:
    """Seconds for ``reps`` calls of ``call`` in a chain, each taking the last one's
    output (shaped as ``x``) as its input, queued before one wait: one after another, as
    a step's layers run. Calls that do not depend on each other may run at once on a GPU
    (MLX's CUDA graphs order their launches by what each reads), so a queue of
    independent calls times a kernel that leaves most of the GPU idle as if it filled it:
    on the H100 (12-06) one stream's attention over 7,800 positions in 8 blocks took 30
    us a call in such a queue and ~310 us inside the step, where a split form of 264
    blocks that the queue timed slower took ~70. The chain is built before the clock
    starts: building costs the host alone, which a pipelined step overlaps with the GPU's
    work (the whole-step confirmations count it), and timed here it made a busy host pick
    MLX's product over faster kernels (the H200 with llama.cpp compiling beside it, 12-03:
    every one-row kernel lost)."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(call(x))
    y = x
    for _ in range(reps):
        y = call(y)
    start = time.perf_counter()
    mx.eval(y)
    return time.perf_counter() - start


# a timing's longer run, in its shorter one's calls, and the rounds of both (:func:`per_call`)
LONGER = 4
ROUNDS = 3


def per_call(run: Callable[[int], float], reps: int, rounds: int = ROUNDS) -> float:
    """Seconds a call of what ``run(n)`` times ``n`` calls of: the slope between ``reps``
    and :data:`LONGER` times as many, each the least of ``rounds`` runs (a short and a
    long one in turn, so a machine whose speed drifts favours neither), or the longer
    run's time a call where the slope is not positive (noise larger than the difference).
    Why: a run's own cost is in its total and not in its calls (the first commands
    encoded before the device starts, the device's clocks rising from idle, the last
    wait), and over a few dozen calls it is as large as the differences a tuner looks
    for. On an H100 (12-07) a load's chain of 32 timed the 8B's one-row products at
    43.7-60.3 us a call, where ncu timed the same kernels at 29.7-33.6, and the shapes
    ranked differently from load to load."""
    short = long = math.inf
    for _ in range(rounds):
        short = min(short, run(reps))
        long = min(long, run(LONGER * reps))
    slope = (long - short) / ((LONGER - 1) * reps)
    return slope if slope > 0 else long / (LONGER * reps)


def chain_call_time(call: Callable[[Any], Any], x: Any, reps: int) -> float:
    """Seconds a call of :func:`chain_time`'s chain from ``x``: its slope between chains
    of ``reps`` and :data:`LONGER` times as many calls (:func:`per_call`)."""
    return per_call(lambda n: chain_time(call, x, n), reps)


# the lead's product: (rows, LEAD_K) @ (LEAD_K, LEAD_K), its rows doubled (or more) up
# to LEAD_ROWS until the GPU takes long enough over it (2**17 rows: 1.1 TFLOP, 512 MB of
# float16 in and out, ~2 ms on an H200)
LEAD_K = 2048
LEAD_ROWS = 1 << 17


def _once(call: Callable[[], Any]) -> float:
    import mlx.core as mx

    start = time.perf_counter()
    mx.eval(call())
    return time.perf_counter() - start


def lead_for(seconds: float, dtype: Any) -> tuple[Callable[[], Any], float] | None:
    """A product the device takes at least twice ``seconds`` over (one call, its output
    never read), and its seconds alone; None where even :data:`LEAD_ROWS` rows take less."""
    import mlx.core as mx

    b = mx.random.normal((LEAD_K, LEAD_K), key=mx.random.key(1)).astype(dtype)
    rows = 1
    while True:
        a = mx.random.normal((rows, LEAD_K), key=mx.random.key(2)).astype(dtype)
        mx.eval(a, b)

        def lead(a: Any = a) -> Any:
            return a @ b

        mx.eval(lead())
        alone = min(_once(lead), _once(lead))
        if alone >= 2 * seconds:
            return lead, alone
        if rows >= LEAD_ROWS:
            return None
        rows = min(LEAD_ROWS, rows * min(64, max(2, int(2 * seconds / max(alone, 1e-7)) + 1)))


# paired measures a device part is the median of (:func:`device_chain_time`)
DEVICE_ROUNDS = 3


def device_chain_time(call: Callable[[Any], Any], x: Any, reps: int) -> float:
    """:func:`chain_time`'s calls with the host's part hidden: the whole chain handed
    over while the device works through a lead product (:func:`lead_for`, sized to twice
    the chain's own time, which is at least the host's), then the lead's time alone taken
    away. What is left is the device's time for the calls one after another. Why: a small
    kernel's chain is the host's (each call's MLX operations built and handed over, ~6 us
    each on the H200's host), so every launch shape of a small product times alike and the
    fastest is noise: on the H200 (12-06 night) the q-k-v shapes timed 22-26 us at load,
    the one taken ran 20.7 us in the step where another ran the same layers in 12.5-13.5.

    The difference is the median of :data:`DEVICE_ROUNDS` pairs, the lead alone timed
    just before each chain behind it: one pair's difference carries the lead's own
    jitter, as large as a short chain, and the least of several such differences is their
    noise, not the chain (H100, 12-07: one pair a call, the least of three calls, timed
    the 8B's 4096x4096 product at 0.3 us, 35 TB/s). Falls back to :func:`chain_time`
    where no lead is long enough or nothing is left."""
    import mlx.core as mx

    plain = chain_time(call, x, reps)
    found = lead_for(plain, x.dtype)
    if found is None:
        return plain
    lead, _ = found
    left = []
    for _ in range(DEVICE_ROUNDS):
        alone = _once(lead)
        y = x
        for _ in range(reps):
            y = call(y)
        head = lead()
        start = time.perf_counter()
        mx.async_eval(head)  # the device starts the lead; the chain queues behind it
        mx.eval(y)
        left.append(time.perf_counter() - start - alone)
    middle = statistics.median(left)
    return middle if middle > 0 else plain


def queue_time(call: Callable[[], Any], reps: int) -> float:
    """Seconds for ``reps`` calls of ``call`` that do not depend on each other, queued
    before one wait: how the load times its products (:func:`fast_linear._measure` says
    why, and when :func:`chain_time` instead). Such a queue may run at once on a GPU."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(call())
    outs = [call() for _ in range(reps)]
    start = time.perf_counter()
    mx.eval(outs)
    return time.perf_counter() - start


# candidates timed within this fraction of the fastest are timed again (:func:`runoff`), in turn
RUNOFF_MARGIN = 0.15
RUNOFF_ROUNDS = 2


def runoff(times: dict[Any, float]) -> list[Any]:
    """What to time again after each of ``times`` (a candidate's seconds: a launch shape,
    a product's path; the default or reference first) was timed once: those within
    :data:`RUNOFF_MARGIN` of the fastest, when more than one is, in turn
    :data:`RUNOFF_ROUNDS` times, forward then back (each keeping the least of its
    times), so the first of them is also timed last: a GPU still speeding up favours
    what it meets later, and the default is what must be beaten. Why: one timing each
    picks between close candidates by noise. On an H100 (12-07) two loads of the same 8B
    took the gate-up-swiglu at 4x2 depth 4 (29.0 us in the step) and at 4x2 (32.1 us),
    ~0.1 ms a step apart; the close contenders timed again are chosen by more than one
    sample each, for a few chains more at load (their kernels are built already)."""
    if not times:
        return []
    fastest = min(times.values())
    close = [name for name, took in times.items() if took <= fastest * (1 + RUNOFF_MARGIN)]
    if len(close) < 2:
        return []
    return [name for turn in range(RUNOFF_ROUNDS) for name in (close if turn % 2 == 0 else close[::-1])]
