"""A burst of prompts arriving while streams decode: how fast each gets its first token,
gmlx's worker against mlx-lm's BatchGenerator driven directly (the peer), in one run.

    python benchmarks/burst.py                                    # tiny model, CPU-friendly
    python benchmarks/burst.py --shape llama3-8b --burst 32 --prompt 128   # on an accelerator

``--decoding`` streams start first and decode throughout; once they are decoding,
``--burst`` prompts of ``--prompt`` tokens arrive at once, each asking for 8 tokens. Per
side: the burst's TTFT p50 and p95 (from the burst's arrival to each prompt's first
token) and when the last first token came; the ratio column is gmlx / mlx-lm (below 1:
gmlx admits the burst sooner). The peer prefills with mlx-lm's defaults (up to
``prefill_batch_size`` 8 prompts a step, 2048-token chunks); gmlx with its own (a
prefill chunk of 512 tokens on the CPU, 2048 on a GPU, of which a step beside decoding
streams takes the waiting prompts' share).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_throughput import SHAPES, build, prompts
from benchmarks.throughput import percentile

WIDTH = 64  # streams that may decode together, on both sides


def run_peer(loaded, decoding: int, burst: int, prompt_len: int) -> list[float]:
    """Seconds from the burst's arrival to each burst prompt's first token, mlx-lm's
    BatchGenerator with its own prefill settings."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(loaded.model, stop_tokens=[], completion_batch_size=WIDTH)
    background = set(gen.insert(prompts(decoding, 16), max_tokens=[4_000] * decoding))
    started: set[int] = set()
    while started != background:
        started |= {r.uid for r in gen.next()[1]}
    t0 = time.perf_counter()
    arrivals = gen.insert([p[:prompt_len] for p in prompts(burst + decoding, prompt_len)[decoding:]],
                          max_tokens=[8] * burst)
    first: dict[int, float] = {}
    while len(first) < burst:
        for r in gen.next()[1]:
            if r.uid not in background and r.uid not in first:
                first[r.uid] = time.perf_counter() - t0
    gen.close()
    return [first[uid] for uid in arrivals]


def run_gmlx(loaded, decoding: int, burst: int, prompt_len: int) -> list[float]:
    """The same through gmlx's ModelWorker, each stream read on a thread of its own."""
    from gmlx.engine.types import GenerateRequest, SamplingParams
    from gmlx.engine.worker import ModelWorker

    greedy = SamplingParams(temperature=0)
    worker = ModelWorker(loaded, decode_batch=WIDTH, prompt_cache_bytes=0)
    try:
        background = [worker.submit(GenerateRequest(tuple(p), max_tokens=4_000, sampling=greedy))
                      for p in prompts(decoding, 16)]
        for handle in background:
            next(iter(handle))
        firsts: list[float] = []
        t0 = time.perf_counter()
        handles = [worker.submit(GenerateRequest(tuple(p), max_tokens=8, sampling=greedy))
                   for p in prompts(burst + decoding, prompt_len)[decoding:]]

        def read(handle) -> None:
            for ev in handle:
                if ev.token_ids:
                    firsts.append(time.perf_counter() - t0)
                    break
            for _ in handle:
                pass

        readers = [threading.Thread(target=read, args=(h,)) for h in handles]
        for r in readers:
            r.start()
        for r in readers:
            r.join()
        for handle in background:
            worker.cancel(handle.id)
            for _ in handle:
                pass
        return firsts
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--decoding", type=int, default=1, help="streams decoding when the burst arrives")
    parser.add_argument("--burst", type=int, default=16, help="prompts arriving at once")
    parser.add_argument("--prompt", type=int, default=128, help="tokens per burst prompt")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating; medians kept")
    args = parser.parse_args()

    loaded = build(args.shape, args.dtype)
    print(f"device: {mx.default_device()}  shape: {args.shape}  dtype: {args.dtype}  decoding: {args.decoding}  "
          f"burst: {args.burst} x {args.prompt} tokens")
    run_peer(loaded, 1, 2, 8)  # warm up kernels for both
    run_gmlx(loaded, 1, 2, 8)
    sides: dict[str, list[list[float]]] = {"mlx-lm": [], "gmlx": []}
    for r in range(args.rounds):
        order = ("mlx-lm", "gmlx") if r % 2 == 0 else ("gmlx", "mlx-lm")
        for side in order:
            run = run_peer if side == "mlx-lm" else run_gmlx
            sides[side].append(run(loaded, args.decoding, args.burst, args.prompt))
    print(f"{'':>7} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'last ms':>9}")
    rows = {}
    for side, runs in sides.items():
        rows[side] = [statistics.median(stat(t) * 1e3 for t in runs)
                      for stat in (statistics.median, lambda t: percentile(t, 0.95), max)]
        print(f"{side:>7} {rows[side][0]:>12.0f} {rows[side][1]:>12.0f} {rows[side][2]:>9.0f}")
    ratio = [g / p for g, p in zip(rows["gmlx"], rows["mlx-lm"], strict=True)]
    print(f"{'ratio':>7} {ratio[0]:>12.2f} {ratio[1]:>12.2f} {ratio[2]:>9.2f}   (gmlx / mlx-lm; below 1 is sooner)")


if __name__ == "__main__":
    main()
