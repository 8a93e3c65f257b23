"""Where a generator's decode step loses to the model's bare step: one model in one
process, ms per token at each width in the loops below, each phase of the host's loop timed.

On the H200 (12-03, an 8B in bf16, width 1) the bare step, built, handed over and
waited for one at a time, took 7.04 ms (142 tok/s), and mlx-lm's BatchGenerator, which
hands the next step over before it waits for the current one, 8.86 ms a token (112.9
tok/s), where overlapping the host's building with the GPU's work should have made it
faster. The loops here add mlx-lm's pieces one at a time:

- ``waited``: build the step (model, argmax), hand it over (``mx.async_eval``), wait
  (``mx.eval``), read the tokens (``tolist``); the next step starts after.
- ``pipelined``: mlx-lm's order: build step n+1 from step n's lazy tokens, hand it
  over, then wait for step n and read its tokens.
- ``logprobs``: ``pipelined`` plus what mlx-lm's step adds for every stream: the
  normalized log-probabilities (``logits - logsumexp``), split per stream and waited for.
- ``batch cache``: ``pipelined`` on mlx-lm's batch KV cache (what its BatchGenerator
  decodes on): its one-token steps carry a left-padding mask even when nothing is
  padded, and MLX's CUDA attention takes its one-query kernel only without one.
- ``kernel``: ``batch cache`` with mlx-lm's attention routed as gmlx routes it on CUDA:
  a masked one-query step in gmlx's kernel (``gmlx.engine.kernels.attention_cuda``).
- ``gmlx cache``: ``pipelined`` on gmlx's batch KV cache, unmasked while nothing is padded.
- ``threaded``: ``pipelined`` with each step handed over (``mx.async_eval``, which lets
  go of the GIL) on a second thread while this one builds the next: the host's two parts
  overlap, so a host-bound step should cost the larger of them rather than their sum. The
  arrays live on a stream any thread may evaluate (``mx.new_thread_unsafe_stream``); a
  step's tokens are read only after it was handed over, so no array is evaluated by two
  threads at once.
- ``chunkedN`` (e.g. ``chunked8``): ``pipelined`` with the forward pass handed over every
  N layers on a second thread while this one builds the next N
  (``gmlx.engine.handover``, what ``GMLX_HANDOVER_LAYERS=N`` does in a server).
- ``one token``: ``gmlx cache`` with the attention's one-token steps in four operations
  fewer a layer (``gmlx.engine.kernels.one_token``, a server's default: the reshapes
  around an attention of one token need no transposes).
- ``add norm``: ``one token`` with each residual add and the RMSNorm after it in one
  kernel (``gmlx.engine.kernels.add_norm_cuda``, ``GMLX_ADD_NORM_KERNEL=1`` in a server:
  two operations fewer a layer; CUDA only).
- ``rope``: ``one token`` with the queries and keys reshaped and rotated in one kernel
  (``gmlx.engine.kernels.rope_cuda``, ``GMLX_ROPE_KERNEL=1``: three operations fewer a
  layer; CUDA only); ``all kernels``: ``add norm`` and ``rope`` together.
- ``glu``: ``one token`` with each MLP's gate and up projections and swiglu in one kernel
  (``gmlx.engine.kernels.glu_cuda``, ``GMLX_GLU_KERNEL=1``: two kernels fewer a layer,
  the two products' reads in one; CUDA only, up to eight streams); ``qkv``: with each
  attention's queries, keys and values in one product (``qkv_cuda``, ``GMLX_QKV_KERNEL=1``:
  up to two kernels fewer a layer); ``step kernels``: both (a server's load takes each
  where it measures faster).
- ``generator``: mlx-lm's BatchGenerator itself (greedy, no processors).

    python benchmarks/gpu/pipeline_check.py synthetic:llama3-8b --float --widths 1,32
    python benchmarks/gpu/pipeline_check.py demo --widths 1,4            # here, on the CPU
    python benchmarks/gpu/pipeline_check.py synthetic:llama3-8b --widths 1 --count --loops "gmlx cache"
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_throughput import run_peer
from benchmarks.gpu.served_step import LAYERED, attention, layered, load
from gmlx.engine.kernels import cuda_source

PHASES = ("build", "hand over", "wait", "read")
LOOPS = ("waited", "pipelined", "logprobs", "batch cache", "kernel", "gmlx cache", "one token", "add norm", "rope",
         "all kernels", "glu", "qkv", "step kernels", "threaded", "chunked8")


def _primed(model, width: int, context: int, kind: str = "plain"):
    """A prompt cache (``kind``: plain, mlx-lm's batch cache or gmlx's) after a
    ``context``-token prefill of ``width`` streams, and the first tokens."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from gmlx.engine.prompt_cache import _AlignedBatchKVCache

    cache = make_prompt_cache(model)
    if kind != "plain":
        batch = BatchKVCache if kind == "batch cache" else _AlignedBatchKVCache
        cache = [batch([0] * width) for _ in cache]
    logits = model(mx.zeros((width, context), mx.int32), cache=cache)
    tokens = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tokens)
    return cache, tokens


def loop(model, width: int, mode: str, steps: int, context: int = 128) -> tuple[float, dict[str, float], list]:
    """Seconds per token of one stream, the host's seconds per step in each phase, and
    the last step's tokens."""
    attention(mode == "kernel")
    kind = "batch cache" if mode == "kernel" else mode if mode.endswith("cache") else "plain"
    cache, tokens = _primed(model, width, context, kind)
    spent = dict.fromkeys(PHASES, 0.0)

    def step(tokens):
        logits = model(tokens[:, None], cache=cache)[:, -1, :]
        nxt = mx.argmax(logits, axis=-1)
        if mode != "logprobs":
            return nxt, []
        return nxt, list(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    current, current_lp = tokens, []
    start = 0.0
    for i in range(steps + 3):
        if i == 3:  # the first steps compile and allocate
            start = time.perf_counter()
            spent = dict.fromkeys(PHASES, 0.0)
        t0 = time.perf_counter()
        nxt, nxt_lp = step(current)
        t1 = time.perf_counter()
        mx.async_eval(nxt, nxt_lp)
        t2 = time.perf_counter()
        if mode == "waited":
            mx.eval(nxt)
            t3 = time.perf_counter()
            nxt.tolist()
        else:
            mx.eval(current, current_lp)
            t3 = time.perf_counter()
            current.tolist()
        t4 = time.perf_counter()
        for phase, t in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[phase] += t
        current, current_lp = nxt, nxt_lp
    mx.eval(current)
    elapsed = time.perf_counter() - start
    return elapsed / steps, {k: v / steps for k, v in spent.items()}, current.tolist()


def threaded(model, width: int, steps: int, context: int = 128) -> tuple[float, dict[str, float], list]:
    """``pipelined``, each step handed over on a second thread while the next is built;
    as :func:`loop` returns (``hand over``: the building thread waiting for the other to
    have handed the step over)."""
    import queue
    import threading

    stream = mx.new_thread_unsafe_stream(mx.default_device())
    todo: queue.SimpleQueue = queue.SimpleQueue()
    handed: queue.SimpleQueue = queue.SimpleQueue()

    def hand_over() -> None:
        while (arrays := todo.get()) is not None:
            mx.async_eval(arrays)
            handed.put(arrays)

    thread = threading.Thread(target=hand_over, name="hand-over", daemon=True)
    thread.start()
    spent = dict.fromkeys(PHASES, 0.0)
    try:
        with mx.stream(stream):
            cache, current = _primed(model, width, context)
            todo.put(current)
            start = 0.0
            for i in range(steps + 3):
                if i == 3:
                    start = time.perf_counter()
                    spent = dict.fromkeys(PHASES, 0.0)
                t0 = time.perf_counter()
                nxt = mx.argmax(model(current[:, None], cache=cache)[:, -1, :], axis=-1)
                t1 = time.perf_counter()
                handed.get()  # ``current`` handed over: only now may it be waited for
                todo.put(nxt)
                t2 = time.perf_counter()
                mx.eval(current)
                t3 = time.perf_counter()
                current.tolist()
                t4 = time.perf_counter()
                for phase, t in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    spent[phase] += t
                current = nxt
            handed.get()
            mx.eval(current)
            elapsed = time.perf_counter() - start
    finally:
        todo.put(None)
        thread.join()
    return elapsed / steps, {k: v / steps for k, v in spent.items()}, current.tolist()


def operations(model, width: int, mode: str) -> collections.Counter:
    """The operations of one decode step's graph in ``mode``'s model and cache (``gmlx
    cache`` or one of ``LAYERED``), by kind: what the host builds and hands to MLX each step.
    (On the CPU MLX's fast operations, rope and attention among them, are built from
    several; on a GPU each is one.)"""
    import re
    import tempfile

    with layered(model, mode):
        cache, tokens = _primed(model, width, 16, "gmlx cache")
        with tempfile.NamedTemporaryFile(suffix=".dot") as f:
            mx.export_to_dot(f.name, mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1))
            return collections.Counter(re.findall(r'label ="([A-Za-z_]+)', Path(f.name).read_text()))


def kernel_difference(model, width: int, mode: str, steps: int = 8) -> tuple[float, float]:
    """The largest difference between the logits of ``steps`` decode steps in ``mode``
    (its kernels) and in ``one token`` (MLX's operations), from the same prompt and the
    same tokens, and the largest logit: how close the kernels keep a whole model (its
    tokens alone say little: a random model's logits are near ties)."""

    def run(mode: str) -> list:
        with layered(model, mode):
            cache, tokens = _primed(model, width, 16, "gmlx cache")
            out = []
            for step in range(steps):
                logits = model(((tokens + step) % 512)[:, None], cache=cache)[:, -1, :]
                mx.eval(logits)
                out.append(logits.astype(mx.float32))
            return out

    want, got = run("one token"), run(mode)
    largest = max(mx.abs(a).max().item() for a in want)
    return max(mx.abs(a - b).max().item() for a, b in zip(want, got, strict=True)), largest


def run_loop(model, width: int, mode: str, steps: int) -> tuple[float, dict[str, float], list]:
    """One row's loop, by its name."""
    from gmlx.engine import handover

    if mode == "threaded":
        return threaded(model, width, steps)
    if mode.startswith("chunked"):
        chunks = handover.attach(model, int(mode.removeprefix("chunked") or 8))
        try:
            with mx.stream(chunks.stream):
                return loop(model, width, "pipelined", steps)
        finally:
            handover.detach(model)
    if mode in LAYERED:
        with layered(model, mode):
            return loop(model, width, "gmlx cache", steps)
    return loop(model, width, mode, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model reference gmlx serve takes, or synthetic:SHAPE")
    p.add_argument("--widths", default="1,32")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="synthetic: float type")
    p.add_argument("--float", action="store_true", help="synthetic: float weights, not Q4_K_M's layouts")
    p.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {','.join(LOOPS)} "
                   "(kernel, add norm, rope, all kernels, glu, qkv, step kernels: CUDA only)")
    p.add_argument("--no-generator", action="store_true", help="skip mlx-lm's BatchGenerator row")
    p.add_argument("--count", action="store_true", help="first print the operations of one decode step "
                   "(gmlx cache and one token), by kind")
    args = p.parse_args()
    loaded = load(args.model, args.dtype, not args.float)
    print(f"device {mx.default_device()}; model {args.model}; {args.steps} steps after 3; host ms per step by phase")
    for width in (int(w) for w in args.widths.split(",")) if args.count else ():
        for mode in ("gmlx cache", "one token", *(("all kernels",) if cuda_source.available() else ())):
            kinds = operations(loaded.model, width, mode)
            print(f"width {width}, {mode}: {sum(kinds.values())} operations a step ("
                  + ", ".join(f"{k} {n}" for k, n in kinds.most_common()) + ")", flush=True)
    for mode in (m for m in args.loops.split(",") if LAYERED.get(m) and cuda_source.available()):
        for width in (int(w) for w in args.widths.split(",")):
            diff, largest = kernel_difference(loaded.model, width, mode)
            print(f"width {width}, {mode} against MLX's operations, 8 steps: largest logit difference "
                  f"{diff:.4f} (largest logit {largest:.2f})", flush=True)
    print("| width | loop | ms / step | tok/s | build | hand over | wait | read | last tokens as the first loop's |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    kernel = ("kernel",) if cuda_source.available() else ()
    for width in (int(w) for w in args.widths.split(",")):
        want = None
        for mode in args.loops.split(","):
            if (mode == "kernel" or LAYERED.get(mode)) and not kernel:
                continue
            per_step, spent, last = run_loop(loaded.model, width, mode, args.steps)
            same = "" if want is None else "yes" if last == want else "no"
            want = last if want is None else want  # the first loop's tokens: what the others must give
            phases = " | ".join(f"{spent[k] * 1e3:.2f}" for k in PHASES)
            print(f"| {width} | {mode} | {per_step * 1e3:.2f} | {width / per_step:.1f} | {phases} | {same} |",
                  flush=True)
        attention(False)
        if args.no_generator:
            continue
        rate = run_peer(loaded, width, 128, args.steps)
        print(f"| {width} | generator | {width / rate * 1e3:.2f} | {rate:.1f} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
