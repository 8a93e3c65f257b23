"""Why a long conversation's decode step is slower than a short one's: one model loaded
as a server loads it (``prepare_layers``), its one-stream decode step timed over a batch
cache already holding ``L`` positions (random keys and values, the arrays as long as a
served cache of that length: whole steps of the cache's ``step``), for each ``--lengths``, in variants
that each leave one part of the step out or swap it:

    served       the step as served (the whole step compiled, the in-place attention)
    pieces       the blocks compiled in pieces (``whole_step`` off), the same attention
    no attention the served step with the attention replaced by a free stand-in (its
                 queries, reshaped): what the rest of the step costs at this length
    warp / lane  the served step with the in-place attention's layout forced
    whole / split  ... and its splits forced (one block a head, or the split form: toward
                 two blocks an SM; ``split x2`` twice that)

and the step's attention alone (the same kernel over the same arrays, the layers' calls
queued together, independent of each other: what the load's timing measured before
12-06). Then, with ``--served``, a worker's round of one ``L``-token prompt (a real
prefill, as a server runs it): its decode steps' median and slowest, and the traces the
whole step holds after it. Each step's first call (a trace, at a new cache length) is
printed apart from the median of the rest.

    python benchmarks/gpu/long_steps.py synthetic:llama3-8b --lengths 128,2048,7800 --served
    python benchmarks/gpu/long_steps.py demo --lengths 64,1024     # here, on the CPU (plain steps)

On the H100 a served 7,800-token conversation decoded at 12.5 ms a step where a short
one took 3.6: this says which part of the step grew.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

def filled_cache(model: Any, length: int, room: int) -> list[Any]:
    """One stream's batch cache (gmlx's, as the worker holds it) whose layers hold
    ``length`` positions of random keys and values, the arrays long enough for ``room``
    more steps (whole steps of the cache's ``step``, as it grows them)."""
    import mlx.core as mx

    from gmlx.engine.prompt_cache import batch_cache

    layers = batch_cache(model, 1)
    if layers is None:
        raise SystemExit("the model's layers are not all plain KV caches")
    attention = next(m for _, m in model.named_modules() if hasattr(m, "n_kv_heads"))
    dtype = attention.o_proj.scales.dtype if "scales" in attention.o_proj else attention.o_proj.weight.dtype
    capacity = -(-(length + room) // layers[0].step) * layers[0].step
    head_dim = getattr(attention, "head_dim", None) or attention.k_proj.weight.shape[0] // attention.n_kv_heads
    shape = (1, attention.n_kv_heads, capacity, head_dim)
    for c in layers:
        c.keys = (0.5 * mx.random.normal(shape)).astype(dtype)
        c.values = mx.random.normal(shape).astype(dtype)
    rewind(layers, length)
    mx.eval([(c.keys, c.values) for c in layers])
    return layers


def rewind(layers: list[Any], length: int) -> None:
    """Make ``layers`` hold their first ``length`` positions (the rest free again)."""
    import mlx.core as mx

    from gmlx.engine.mlxlm import set_kv_used

    for c in layers:
        c.offset = mx.array([length])
        set_kv_used(c, length)


def time_steps(model: Any, layers: list[Any], length: int, steps: int) -> tuple[float, float]:
    """The first step's ms (a trace where the step is compiled) and the median of the
    rest, each step evaluated before the next, from ``length`` positions."""
    import mlx.core as mx

    rewind(layers, length)
    tokens = mx.array([[1000]])
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens, cache=layers)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
        tokens = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
    return times[0] * 1000, statistics.median(times[1:]) * 1000


def attention_alone(model: Any, layers: list[Any], length: int, reps: int = 20) -> float | None:
    """ms a step for the in-place attention alone: each layer's call over its own arrays,
    a step's worth queued together (the queries random), independent of each other as no
    step's are: the GPU runs them at once, so against the step's own attention this shows
    what a queue of independent calls hides. None where the kernel is not built."""
    import mlx.core as mx

    from gmlx.engine.kernels import cached_attention_cuda

    if not cached_attention_cuda.cached_enabled():
        return None
    attn = [m for _, m in model.named_modules() if getattr(m, "_in_place", False)]
    if len(attn) != len(layers):
        return None
    a = attn[0]
    dtype = layers[0].keys.dtype
    d = layers[0].keys.shape[3]
    q = mx.random.normal((1, a.n_heads, 1, d)).astype(dtype)
    kv = mx.random.normal((1, a.n_kv_heads, 1, d)).astype(dtype)
    position = mx.array([length], dtype=mx.int32)
    mx.eval(q, kv)

    def step() -> None:
        outs = [cached_attention_cuda.attend_cached(q, kv, kv, c.keys, c.values, c.left_padding, position, m.scale)
                for m, c in zip(attn, layers, strict=True)]
        mx.eval(outs)

    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


@contextlib.contextmanager
def swapped_attention(model: Any, attend: Callable[..., Any]) -> Iterator[None]:
    """``model``'s steps with ``attend`` for ``cached_attention_cuda.attend_cached`` (the
    traces made again on both sides)."""
    from gmlx.engine.kernels import cached_attention_cuda, traces

    original = cached_attention_cuda.attend_cached
    cached_attention_cuda.attend_cached = attend
    traces.retrace(model)
    try:
        yield
    finally:
        cached_attention_cuda.attend_cached = original
        traces.retrace(model)


@contextlib.contextmanager
def pieces(model: Any) -> Iterator[None]:
    from gmlx.engine.kernels import traces

    object.__setattr__(model, "_whole_off", True)
    try:
        yield
    finally:
        object.__setattr__(model, "_whole_off", False)
        traces.retrace(model)


def free_attention(q: Any, k_new: Any, v_new: Any, keys: Any, values: Any, padding: Any, position: Any,
                   scale: float, n: int | None = None, layout: str | None = None) -> Any:
    b, heads, _, d = q.shape
    return q.reshape(b, 1, heads * d)


def split_attention(attend: Callable[..., Any], factor: int) -> Callable[..., Any]:
    """``attend`` in its split form, ``factor`` times the splits it would make whatever
    the length (at most one a ``MIN_KEYS`` positions of the capacity)."""
    from gmlx.engine.kernels import cached_attention_cuda as cached

    def call(q: Any, k_new: Any, v_new: Any, keys: Any, values: Any, padding: Any, position: Any, scale: float,
             n: int | None = None, layout: str | None = None) -> Any:
        capacity = keys.shape[2]
        n = max(1, min(factor * cached.splits(q.shape[0] * keys.shape[1], capacity, 0), capacity // cached.MIN_KEYS))
        return attend(q, k_new, v_new, keys, values, padding, position, scale, n=n, layout=layout)

    return call


def variants(model: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The variants the model takes here, each a context manager's factory."""
    from gmlx.engine.kernels import cached_attention_cuda, traces

    out: list[tuple[str, Callable[[], Any]]] = [("served", contextlib.nullcontext)]
    if traces.whole(model):
        out.append(("pieces", lambda: pieces(model)))
    if any(getattr(m, "_in_place", False) for _, m in model.named_modules()):
        attend = cached_attention_cuda.attend_cached
        out += [("no attention", lambda: swapped_attention(model, free_attention)),
                ("warp", lambda: swapped_attention(model, partial(attend, layout="warp"))),
                ("lane", lambda: swapped_attention(model, partial(attend, layout="lane"))),
                ("whole", lambda: swapped_attention(model, partial(attend, n=1))),
                ("split", lambda: swapped_attention(model, split_attention(attend, 1))),
                ("split x2", lambda: swapped_attention(model, split_attention(attend, 2)))]
    return out


def served_round(worker: Any, steps: Any, length: int, tokens: int) -> str:
    """One request of ``length`` prompt tokens through the worker (``steps``: burst_steps'
    ``StepLog``, patched in): its decode steps."""
    from benchmarks.gpu.burst_steps import run_round

    ttfts = run_round(worker, steps, 1, length, tokens, 0, seed=length)
    decode = [took * 1000 for _, took, left, *_ in steps.rows if left == "-"]
    if not decode:
        return f"TTFT {ttfts[0] * 1000:.0f} ms, no decode steps"
    times = sorted(decode)
    slowest = sorted(range(len(decode)), key=lambda i: -decode[i])[:4]
    return (f"TTFT {ttfts[0] * 1000:.0f} ms; {len(decode)} decode steps: median {statistics.median(times):.2f} ms, "
            f"p90 {times[int(0.9 * (len(times) - 1))]:.2f}, slowest "
            + ", ".join(f"#{i} {decode[i]:.1f}" for i in slowest))


def whole_state(model: Any) -> str:
    from gmlx.engine.kernels import traces

    if not traces.whole(model):
        return "no whole step"
    kept = getattr(model, traces.WHOLE_TRACED) or {}
    return (f"whole step {'OFF' if getattr(model, '_whole_off', False) else 'on'}, traces held "
            + (", ".join(f"{w}x{n}" for w, n in kept) or "none"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model reference gmlx serve takes, or synthetic:SHAPE")
    parser.add_argument("--lengths", default="128,2048,7800")
    parser.add_argument("--steps", type=int, default=24, help="timed steps a variant (after its first)")
    parser.add_argument("--variants", default="", help="a comma-separated subset (default: all the model takes)")
    parser.add_argument("--served", action="store_true", help="also a worker's round at each length")
    parser.add_argument("--tokens", type=int, default=200, help="--served: tokens generated")
    parser.add_argument("--dtype", default="float16", help="synthetic: float type")
    args = parser.parse_args()

    from benchmarks.gpu.burst_steps import StepLog
    from benchmarks.gpu.served_step import load
    from gmlx.engine.kernels import prepare_layers

    started = time.perf_counter()
    loaded = load(args.model, args.dtype)
    notes = prepare_layers(loaded.model)
    model = loaded.model
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s; {'; '.join(notes) or 'no notes'}",
          flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    chosen = [v for v in variants(model) if not args.variants or v[0] in args.variants.split(",")]
    print(f"\none stream, ms a step: first (a trace where compiled) / median of {args.steps}")
    print(f"{'length':>7} {'capacity':>8}  " + "  ".join(f"{name:>14}" for name, _ in chosen) + f"  {'attention':>9}")
    for length in lengths:
        layers = filled_cache(model, length, args.steps + 2)
        cells = []
        for _, context in chosen:
            with context():
                first, median = time_steps(model, layers, length, args.steps)
            cells.append(f"{first:6.1f} / {median:5.2f}")
        alone = attention_alone(model, layers, length)
        print(f"{length:>7} {layers[0].keys.shape[2]:>8}  " + "  ".join(f"{c:>14}" for c in cells)
              + f"  {'-' if alone is None else f'{alone:.2f}':>9}", flush=True)
        del layers
    print(whole_state(model))
    if not args.served:
        return
    from gmlx.engine.worker import ModelWorker

    steps = StepLog()
    steps.patch()
    worker = ModelWorker(loaded, decode_batch=1)
    try:
        print(f"\nwarm-up {worker.warm_up():.1f} s; {whole_state(model)}", flush=True)
        for length in lengths:
            print(f"served, a {length}-token prompt: {served_round(worker, steps, length, args.tokens)}; "
                  f"{whole_state(model)}", flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
