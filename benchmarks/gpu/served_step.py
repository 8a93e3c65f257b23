"""Where a served decode step's time goes, for one model file, in one process: the
model's bare step (graph build and evaluation timed apart), mlx-lm's BatchGenerator and
gmlx's worker on the same weights, with the quantized layers as MLX leaves them
(``plain``), only flattened (``flat``) and with the tuned paths (``tuned``); ``clear``
empties MLX's buffer cache between modes; ``one-token`` gives the attention layers the
one-token steps a server's load gives them (``gmlx.engine.kernels.one_token``: four
operations fewer a layer), ``add-norm``, ``rope``, ``all-kernels``, ``glu``, ``qkv`` and
``step-kernels`` (glu and qkv) add those kernels to them (CUDA only: ``LAYERED``), ``compiled`` and
``step-compiled`` run the one-token blocks in two compiled pieces each, ``served`` has the
layers exactly as a server's load leaves them (``prepare_layers``: its tuning read from
``GMLX_HOME``, the whole step compiled where it applies; a last mode: nothing is undone
after it) and adds the pipelined bare loop's rate (``pipelined tok/s``, the worker's loop
at no cost of its own) and no mlx-lm row (its own cache is not the one those layers
take); with ``GMLX_STEP_TIMES=N`` the worker logs its steps' phases
(``gmlx.engine.step_times``); (``cached``: that with
each step's keys and values written in place by the attention kernel,
``cached_attention_cuda.attend_cached``; ``whole``: that with the whole one-token step one
compiled call, ``whole_step``)
(``gmlx.engine.kernels.compiled_blocks``, anywhere; mlx-lm's generator, on the same model,
takes them too), ``model-layers`` gives mlx-lm's own back, each for the modes after. The
bare step runs over the worker's batch cache (``prompt_cache.batch_cache``) in every mode.
A mode may come back (``plain,tuned,plain``):
whether a width's rate depends on what the process ran before is one of the questions.

    python benchmarks/gpu/served_step.py /tmp/models/llama3-8b/q4_k_m.gguf [--widths 1,8,32]
    python benchmarks/gpu/served_step.py synthetic:llama3-8b     # no model file: step_check's
                                                                 # in-memory Q4_K_M layouts
    python benchmarks/gpu/served_step.py demo --widths 1,4       # here, on the CPU
    MLX_CUDA_GRAPH_CACHE_SIZE=4000 python benchmarks/gpu/served_step.py synthetic:llama3-8b \
        --modes plain,tuned,plain --widths 1 --bias 0,3000 --dtype float16

The model loads once, through gmlx's own loader (the converted-weights cache makes a
second load of a GGUF quick); the modes are applied one after the other, as
``fast_linear.use_fast_kernels`` does at a server's load (``plain`` and ``flat`` only
on CUDA). Prints one row per mode and width.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_throughput import run_gmlx, run_peer, worker_ttft


def bare_step(model, rows: int, context: int = 128, steps: int = 16) -> tuple[float, float]:
    """Seconds per decode step of ``rows`` streams (each step waited for), of the step's
    graph building alone (the Python side of a step) and of handing it to the GPU
    (``mx.async_eval``: the kernels' launches)."""
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.prompt_cache import batch_cache

    # the worker's batch cache (unmasked, its position an array: compiled blocks take it)
    cache = batch_cache(model, rows) or make_prompt_cache(model)
    mx.eval(model(mx.zeros((rows, context), mx.int32), cache=cache))
    token = mx.zeros((rows, 1), mx.int32)
    for _ in range(3):
        mx.eval(model(token, cache=cache))
    build = launch = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        out = model(token, cache=cache)
        t2 = time.perf_counter()
        mx.async_eval(out)
        launch += time.perf_counter() - t2
        build += t2 - t
        mx.eval(out)
    return (time.perf_counter() - start) / steps, build / steps, launch / steps


def greedy_step(model, rows: int, context: int = 128):
    """The worker's greedy one-token step over its batch cache after a ``context``-token
    prompt: a function of the current tokens (``(rows,)``) to the next, its argmax the one
    a load routed (as served)."""
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.mlxlm import greedy_argmax
    from gmlx.engine.prompt_cache import batch_cache

    cache = batch_cache(model, rows) or make_prompt_cache(model)
    mx.eval(model(mx.zeros((rows, context), mx.int32), cache=cache))

    def step(tokens):
        return greedy_argmax(model(tokens[:, None], cache=cache)[:, -1, :])

    return step


def pipelined_step(model, rows: int, context: int = 128, steps: int = 64) -> float:
    """Seconds per decode step of ``rows`` streams pipelined as a server's loop is (the
    next step built and handed over before the current one's tokens are read), greedy:
    what the worker's loop would take if its own work cost nothing."""
    step = greedy_step(model, rows, context)
    current = mx.zeros((rows,), mx.int32)
    for _ in range(4):
        current = step(current)
        mx.eval(current)
    return pipelined(step, current, steps) / steps


def pipelined(step, current, steps: int) -> float:
    """Seconds for ``steps`` calls of ``step`` (tokens in, the next tokens out) pipelined
    as a server's loop runs them: each handed over before the last one's tokens are read."""
    start = time.perf_counter()
    for _ in range(steps):
        nxt = step(current)
        mx.async_eval(nxt)
        mx.eval(current)
        current.tolist()
        current = nxt
    mx.eval(current)
    return time.perf_counter() - start


def prefix_ttft(loaded, length: int, reps: int = 3) -> tuple[float, float]:
    """Seconds to the first token of a ``length``-token prompt through gmlx's worker
    with the prompt cache on: cold (a miss) and again with a few new tokens after it (a
    hit on ``length`` tokens), the best of ``reps`` of each."""
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(loaded, decode_batch=1)
    try:
        miss, hit = [], []
        for r in range(reps):
            base = [(11 * j + 97 * r) % 700 + 3 for j in range(length)]
            miss.append(worker_ttft(worker, base, 2))
            hit.append(worker_ttft(worker, base + [5, 6, 7, 8 + r], 2))
        return min(miss), min(hit)
    finally:
        worker.close()


def attention(kernel: bool) -> None:
    """mlx-lm's attention as MLX's alone, or routed to gmlx's padded-batch kernel as a
    server's load routes it on CUDA (the route is the process's: set it per run)."""
    from mlx_lm.models import base

    from gmlx.engine import mlxlm
    from gmlx.engine.kernels import attention_cuda, cuda_source

    base.mx = mx
    if kernel and cuda_source.available():
        mlxlm.route_attention(attention_cuda.routed)


def unswap(model) -> None:
    """The quantized layers back to MLX's own classes (a mode after another)."""
    from mlx import nn

    from gmlx.engine.kernels import compiled_blocks, fast_linear

    for _, m in model.named_modules():
        if isinstance(m, fast_linear.FastQuantizedLinear):
            m.__class__ = nn.QuantizedLinear
        elif isinstance(m, fast_linear.FlatQuantizedEmbedding):
            m.__class__ = nn.QuantizedEmbedding
    compiled_blocks.retrace(model)  # their traces hold the layers' paths


def load(ref: str, dtype: str, quantize: bool = True):
    """The model as a server loads it, or ``synthetic:SHAPE``: step_check's random
    weights in a Q4_K_M GGUF's MLX layouts (activations, scales and biases in
    ``dtype``; with ``quantize`` false, float ``dtype`` weights), with the demo model's
    tokenizer."""
    from dataclasses import replace

    from benchmarks.decode_throughput import SHAPES
    from benchmarks.gpu.step_check import build
    from gmlx.engine.loading import load_model

    if not ref.startswith("synthetic:"):
        return load_model(ref)
    shape = ref.removeprefix("synthetic:")
    config = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  tie_word_embeddings=False, **SHAPES[shape])
    return replace(load_model("demo"), id=shape, model=build(shape, dtype, quantize), config=config, context_length=8192)


# the loops that run ``gmlx cache`` with gmlx's one-token layers, and which kernels each adds
LAYERED = {"one token": (), "add norm": ("add norm",), "rope": ("rope",), "all kernels": ("add norm", "rope"),
           "glu": ("glu",), "qkv": ("qkv",), "step kernels": ("glu", "qkv"), "tuned": ("glu", "qkv"),
           "compiled": ("compiled",), "step compiled": ("glu", "qkv", "compiled"),
           "cached": ("glu", "qkv", "compiled", "cached"), "whole": ("glu", "qkv", "compiled", "cached", "whole"),
           "tuned whole": ("glu", "qkv", "compiled", "cached", "whole")}


@contextlib.contextmanager
def layered(model, mode: str):
    """``model`` with ``mode``'s one-token layers (``LAYERED``) for the block's length."""
    from gmlx.engine.kernels import (
        add_norm_cuda,
        compiled_blocks,
        glu_cuda,
        one_token,
        qkv_cuda,
        rope_cuda,
        whole_step,
    )

    kernels = LAYERED.get(mode)
    if kernels is not None:
        one_token.attach(model, rotation=rope_cuda.rotation if "rope" in kernels else (lambda attention: None),
                         in_place="cached" in kernels)
        if "add norm" in kernels:
            add_norm_cuda.attach(model)
        if "glu" in kernels:
            glu_cuda.attach(model)
        if "qkv" in kernels:
            qkv_cuda.attach(model)
        if "compiled" in kernels:
            compiled_blocks.attach(model)
        if "whole" in kernels:
            whole_step.attach(model)
    try:
        yield
    finally:
        whole_step.detach(model)
        compiled_blocks.detach(model)
        one_token.detach(model)
        add_norm_cuda.detach(model)
        glu_cuda.detach(model)


# served_step's layer modes -> LAYERED's loops (``model-layers``: none)
LAYERS = {"one-token": "one token", "add-norm": "add norm", "rope": "rope", "all-kernels": "all kernels",
          "glu": "glu", "qkv": "qkv", "step-kernels": "step kernels", "compiled": "compiled",
          "step-compiled": "step compiled", "cached": "cached", "whole": "whole", "model-layers": "gmlx cache"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model reference gmlx serve takes (a GGUF, a folder, demo)")
    parser.add_argument("--widths", default="1,8,32")
    parser.add_argument("--modes", default="plain,flat,tuned")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--prefix", type=int, default=2048, help="prompt-cache miss/hit prompt length (0: skip)")
    parser.add_argument("--readers", choices=("loop", "threads"), default="loop",
                        help="gmlx's streams read on one event loop, as the server does, or one thread each")
    parser.add_argument("--attention", choices=("mlx", "kernel"), default="kernel",
                        help="gmlx's worker with a padded batch's one-query attention in gmlx's kernel (a "
                             "server's default on CUDA), or with MLX's attention alone (GMLX_ATTENTION_KERNEL=0); "
                             "mlx-lm's BatchGenerator: MLX's always")
    parser.add_argument("--no-serve", action="store_true", help="bare steps only (no BatchGenerator, no worker)")
    parser.add_argument("--bias", default="0",
                        help="comma-separated: rows where every request carries a logit bias of -100 on this "
                             "many token ids (bench.py's client bans every special and partial-UTF-8 token: "
                             "thousands of a 128k vocabulary)")
    parser.add_argument("--dtype", default="bfloat16", help="synthetic: float type (a Q4_K_M GGUF loads as float16)")
    parser.add_argument("--float", action="store_true", help="synthetic: float weights, not Q4_K_M's layouts")
    parser.add_argument("--stack", action="store_true",
                        help="stack the projections that read one input, as a server's load does "
                             "(gmlx.engine.kernels.fused)")
    args = parser.parse_args()

    from gmlx.engine.kernels import fast_linear

    start = time.perf_counter()
    loaded = load(args.model, args.dtype, not args.float)
    if args.stack:
        from gmlx.engine.kernels.fused import fuse_projections

        os.environ["GMLX_FUSE_PROJECTIONS"] = "1"
        loaded.notes.append(fuse_projections(loaded.model) or "nothing to stack")
    graphs = os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE", "default")
    print(f"device: {mx.default_device()}  model: {args.model}  loaded in {time.perf_counter() - start:.1f} s  "
          f"MLX_CUDA_GRAPH_CACHE_SIZE={graphs}")
    vocab = loaded.tokenizer.vocab_size
    biases = [(int(n), {(7919 * i) % vocab: -100.0 for i in range(int(n))} or None) for n in args.bias.split(",")]
    for note in loaded.notes:
        print(f"  note: {note}")
    widths = [int(w) for w in args.widths.split(",")]
    print(f"{'mode':>6} {'width':>5} {'bias':>5} {'step ms':>8} {'build ms':>9} {'launch ms':>9} {'bare tok/s':>11} "
          f"{'mlx-lm tok/s':>13} {'gmlx tok/s':>11} {'gmlx/mlx-lm':>12} {'cache GB':>9}", flush=True)
    layers = None  # the one-token layers the modes run (layered), while set
    for mode in args.modes.split(","):
        if mode == "clear":
            mx.clear_cache()
            continue
        if mode == "served":
            served_rows(loaded, widths, biases, args)
            break
        if mode in LAYERS:
            if layers is not None:
                layers.__exit__(None, None, None)
            layers = None if mode == "model-layers" else layered(loaded.model, LAYERS[mode])
            if layers is not None:
                layers.__enter__()
            kernels = LAYERED.get(LAYERS[mode])
            what = "mlx-lm's own layers" if kernels is None else "one-token attention" + "".join(
                " + compiled blocks" if k == "compiled" else " + the whole step compiled" if k == "whole"
                else f" + the {k} kernel" for k in kernels)
            print(f"  {mode}: the modes after run {what}", flush=True)
            continue
        os.environ["GMLX_QMV_KERNEL"] = {"plain": "0", "flat": "flat", "tuned": "1"}[mode]
        if mode == "plain":
            unswap(loaded.model)
        t = time.perf_counter()
        note = fast_linear.use_fast_kernels(loaded.model)
        if note:
            print(f"  {mode}: {note} ({time.perf_counter() - t:.1f} s)", flush=True)
        for width in widths:
            step, build, launch = bare_step(loaded.model, width, context=args.prompt)
            for n, bias in biases:  # in order, repeats too (0,256,0,256: does the order matter?)
                row = (f"{mode:>6} {width:>5} {n:>5} {step * 1e3:>8.2f} {build * 1e3:>9.2f} {launch * 1e3:>9.2f} "
                       f"{width / step:>11.1f}")
                if not args.no_serve:
                    # one stream untimed first: a step's new operations compile on first use
                    # (MLX's scatter of a bias took seconds once, inside the timed window)
                    attention(False)
                    run_peer(loaded, 1, 8, 8, bias)
                    attention(args.attention == "kernel")
                    run_gmlx(loaded, 1, 8, 8, bias, args.readers)
                    attention(False)
                    peer = run_peer(loaded, width, args.prompt, args.tokens, bias)
                    attention(args.attention == "kernel")
                    ours = run_gmlx(loaded, width, args.prompt, args.tokens, bias, args.readers)
                    attention(False)
                    row += f" {peer:>13.1f} {ours:>11.1f} {ours / peer:>12.2f}"
                print(f"{row} {mx.get_cache_memory() / 1e9:>9.2f}", flush=True)
        if args.prefix:
            miss, hit = prefix_ttft(loaded, args.prefix)
            print(f"{mode:>6} prefix {args.prefix}: TTFT miss {miss * 1e3:.0f} ms, hit {hit * 1e3:.0f} ms", flush=True)


def served_rows(loaded, widths: list[int], biases: list, args: argparse.Namespace) -> None:
    """The ``served`` mode: the layers as a server's load leaves them; per width the
    waited step, the pipelined bare loop and the worker (its streams read as the server
    reads them); the worker's step phases logged where ``GMLX_STEP_TIMES`` is set."""
    import logging

    from gmlx.engine.kernels import prepare_layers

    logging.basicConfig(level=logging.INFO, format="  | %(message)s")
    t = time.perf_counter()
    notes = prepare_layers(loaded.model)
    print(f"  served: {'; '.join(notes) or 'no load notes'} ({time.perf_counter() - t:.1f} s)", flush=True)
    for width in widths:
        step, build, launch = bare_step(loaded.model, width, context=args.prompt)
        piped = pipelined_step(loaded.model, width, context=args.prompt)
        for n, bias in biases:
            run_gmlx(loaded, 1, 8, 8, bias, args.readers)  # a step's new operations compile on first use
            ours = run_gmlx(loaded, width, args.prompt, args.tokens, bias, args.readers)
            print(f"{'served':>6} {width:>5} {n:>5} {step * 1e3:>8.2f} {build * 1e3:>9.2f} {launch * 1e3:>9.2f} "
                  f"{width / step:>11.1f} {'pipelined':>13} {ours:>11.1f} {'':>12} {mx.get_cache_memory() / 1e9:>9.2f}"
                  f"\n{'':>6} pipelined bare loop: {piped * 1e3:.2f} ms a step, {width / piped:.1f} tok/s; "
                  f"the worker {ours / (width / piped):.2f}x of it", flush=True)


if __name__ == "__main__":
    main()
