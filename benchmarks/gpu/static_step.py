"""Whether a decode step compiled once (``mx.compile``) over a fixed-size KV cache costs
the host less than the step mlx-lm builds anew each time: the question behind a
one-stream step that is host-bound on the H200 (an 8B in Q4_K_M's layouts: ~2.3 ms
building the graph in Python and ~4 ms handing ~800 operations to the GPU, against ~1 ms
of weights to read).

mlx-lm's caches write each step's keys at a Python offset and hand attention a view of
the keys so far: every step is a new graph, which ``mx.compile`` cannot replay. Here the
cache's arrays hold ``capacity`` positions from the start, the write position is an array
(``mx.slice_update`` with array start indices, rope with an array offset) and attention
reads all ``capacity`` keys under a mask of those written: one graph for every step, traced
once. Loops, each pipelined as the worker runs them (step n+1 built and handed over before
step n's tokens are read):
- ``plain``: mlx-lm's own cache, unmasked (the step as gmlx's worker runs it today);
- ``static``: the fixed-size cache, not compiled (what the masked full-capacity attention
  costs by itself);
- ``compiled``: the same step through ``mx.compile``;
- ``compiled kernel``: that, with the masked attention in gmlx's one-query kernel (CUDA).

    python benchmarks/gpu/static_step.py synthetic:llama3-8b --capacity 512
    python benchmarks/gpu/static_step.py demo --check          # here: tokens equal mlx-lm's?

Measured on the H200 (2026-12-03, width 1, benchmarks/RESULTS.md): no. Q4_K_M's layouts
9.48 ms plain, 9.82 compiled; bf16 7.82 and 8.37. Compiling removed the Python graph
building but not MLX's per-operation hand-over, which is where a one-stream step's host
time goes; the full-capacity masked attention cost about what compiling saved. (Here on
the CPU, with a two-layer model, compiling halves the step: the Python side dominates.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.served_step import attention, load
from gmlx.engine.kernels import cuda_source


class StaticCache:
    """One layer's keys and values, ``capacity`` positions long, kept in ``store`` (a
    dict ``mx.compile`` reads its inputs from and writes its outputs back to) beside the
    position all layers share (``store["offset"]``, an int32 array)."""

    def __init__(self, store: dict[str, Any], index: int, capacity: int):
        self.store, self.k, self.v, self.capacity = store, f"k{index}", f"v{index}", capacity

    @property
    def offset(self) -> Any:
        return self.store["offset"]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        s = self.store
        at = s["offset"].reshape(1)
        s[self.k] = mx.slice_update(s[self.k], keys, at, axes=(2,))
        s[self.v] = mx.slice_update(s[self.v], values, at, axes=(2,))
        return s[self.k], s[self.v]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        del return_array, window_size
        written = self.store["offset"] + n
        if n == 1:
            return (mx.arange(self.capacity) < written).reshape(1, 1, 1, self.capacity)
        # a prompt chunk: causal within the chunk, every earlier position visible
        rows = self.store["offset"] + mx.arange(n)[:, None]
        return (mx.arange(self.capacity)[None] <= rows).reshape(1, 1, n, self.capacity)


def static_caches(model: Any, width: int, capacity: int) -> tuple[dict[str, Any], list[StaticCache]]:
    """A store of zeroed ``capacity``-long arrays for every layer, and its caches."""
    layers = model.layers
    store: dict[str, Any] = {"offset": mx.array(0, mx.int32)}
    caches = []
    for i, layer in enumerate(layers):
        att = layer.self_attn
        shape = (width, att.n_kv_heads, capacity, att.k_proj.weight.shape[0] // att.n_kv_heads)
        dtype = layer.input_layernorm.weight.dtype
        store[f"k{i}"], store[f"v{i}"] = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        caches.append(StaticCache(store, i, capacity))
    mx.eval(store)
    return store, caches


def stepper(model: Any, store: dict[str, Any], caches: list[StaticCache], compiled: bool):
    """A step: tokens ``(width, 1)`` in, the greedy picks ``(width, 1)`` out, the store's
    position advanced."""

    def step(tokens: Any) -> Any:
        logits = model(tokens, cache=caches)
        store["offset"] = store["offset"] + tokens.shape[1]
        return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)

    return mx.compile(step, inputs=[store], outputs=[store]) if compiled else step


def plain_stepper(model: Any, width: int):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return lambda tokens: mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1, keepdims=True)


def run(step, prompt: Any, steps: int) -> tuple[float, list[list[int]]]:
    """Seconds per step, pipelined, and every step's picks."""
    pending = step(prompt)
    mx.async_eval(pending)
    picked = []
    start = 0.0
    for i in range(steps + 3):
        if i == 3:  # the first steps trace, compile and allocate
            start = time.perf_counter()
        following = step(pending)
        mx.async_eval(following)
        picked.append(pending.reshape(-1).tolist())
        pending = following
    picked.append(pending.reshape(-1).tolist())
    return (time.perf_counter() - start) / steps, picked


def loop(model: Any, mode: str, width: int, prompt_len: int, steps: int, capacity: int):
    attention(mode == "compiled kernel")
    vocab = model.args.vocab_size
    prompt = (mx.arange(width * prompt_len).reshape(width, prompt_len) * 7919) % min(vocab, 1000)
    if mode == "plain":
        return run(plain_stepper(model, width), prompt, steps)
    store, caches = static_caches(model, width, capacity)
    prefill = stepper(model, store, caches, compiled=False)
    first = prefill(prompt)  # the prompt, uncompiled: one graph per prompt length
    mx.eval(first, store)
    step = stepper(model, store, caches, compiled=mode != "static")
    per_step, picked = run(step, first, steps)
    return per_step, [first.reshape(-1).tolist(), *picked]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model reference gmlx serve takes, or synthetic:SHAPE")
    p.add_argument("--widths", default="1")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--capacity", type=int, default=512, help="the fixed cache's positions")
    p.add_argument("--dtype", default="bfloat16", help="synthetic: float type")
    p.add_argument("--float", action="store_true", help="synthetic: float weights, not Q4_K_M's layouts")
    p.add_argument("--check", action="store_true", help="fail unless every loop picks mlx-lm's tokens")
    args = p.parse_args()
    if args.prompt + args.steps + 8 > args.capacity:
        p.error("--capacity must hold the prompt and every step")
    loaded = load(args.model, args.dtype, not args.float)
    modes = ["plain", "static", "compiled"] + (["compiled kernel"] if cuda_source.available() else [])
    print(f"device {mx.default_device()}; model {args.model}; prompt {args.prompt}, capacity {args.capacity}, "
          f"{args.steps} pipelined steps after 3")
    print("| width | loop | ms / step | tok/s | same tokens as plain |")
    print("|---:|---|---:|---:|---|")
    for width in (int(w) for w in args.widths.split(",")):
        want = None
        for mode in modes:
            try:
                per_step, picked = loop(loaded.model, mode, width, args.prompt, args.steps, args.capacity)
            except (RuntimeError, ValueError) as e:  # a backend that cannot run this loop: say so, go on
                print(f"| {width} | {mode} | failed: {str(e).splitlines()[0][:120]} | | |", flush=True)
                continue
            picked = picked[: args.steps + 4]
            want = picked if want is None else want
            same = "yes" if picked == want else next(
                f"from step {i}" for i, (a, b) in enumerate(zip(picked, want, strict=False)) if a != b)
            print(f"| {width} | {mode} | {per_step * 1e3:.2f} | {width / per_step:.1f} | {same} |", flush=True)
            if args.check and same != "yes":
                raise SystemExit(f"{mode} picked other tokens than mlx-lm's own cache ({same})")
    attention(False)


if __name__ == "__main__":
    main()
