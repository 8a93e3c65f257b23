"""Where a burst's time to first token goes, step by step: one model loaded as a server
loads it (gmlx's loader, then ``prepare_layers``: the tuned product paths and kernels),
its worker warmed up as a server's is, then rounds of ``width`` requests arriving
``--spread-ms`` apart (a server's HTTP requests reach the worker a few milliseconds
apart), each round's prompts new (prompt-cache misses) and ``--prompt`` tokens long plus
the round's number (so a round may differ in shape from the last).

    python benchmarks/gpu/burst_steps.py /tmp/models/llama3-8b/q4_k_m.gguf --widths 8,32
    python benchmarks/gpu/burst_steps.py demo --widths 4 --prompt 64     # here, on the CPU
    python benchmarks/gpu/burst_steps.py synthetic:llama3-8b --widths 1 --prompt 7800 --tokens 300 \
        --all-steps --dtype float16    # a long conversation's decode steps, no model file

Prints, per round, every worker step until the last first token: when it started and how
long it took (ms from the round's first request), the prompt tokens each waiting prompt
had left before it (``7x127``: seven prompts of 127), the rows it prefilled
(``prefill_batch_size``), the chunk, the requests decoding; then each request's TTFT.
On the H200 a served width-8 burst of 128-token prompts took 580 ms to its first tokens
where llama-server took 241 and one prompt alone 72: this says which step holds them.
``--all-steps`` prints every step of the round instead, and the decode steps' median,
90th percentile and slowest (a stall among them: a trace, a compile, a cache's growth).
``synthetic:SHAPE`` loads served_step's random weights in Q4_K_M's layouts (``--dtype``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def lengths_text(lengths: list[int]) -> str:
    return " ".join(f"{n}x{length}" for length, n in Counter(lengths).items()) or "-"


class StepLog:
    """Records every step of a worker's batch while ``on``."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.on = False
        self.rows: list[tuple[float, float, str, int, int, int]] = []

    def patch(self) -> None:
        from gmlx.engine import batch, mlxlm

        original = batch.Batch.step
        log = self

        def step(self: Any, stats: Any) -> Any:
            if not log.on:
                return original(self, stats)
            lengths = mlxlm.prefill_lengths(self._gen)
            start = time.perf_counter()
            ended = original(self, stats)
            gen = self._gen
            log.rows.append((start - log.t0, time.perf_counter() - start, lengths_text(lengths),
                             gen.prefill_batch_size if lengths else 0, gen.prefill_step_size if lengths else 0,
                             len(self.running)))
            return ended

        batch.Batch.step = step


def run_round(worker: Any, steps: StepLog, width: int, prompt: int, tokens: int, spread: float,
              seed: int) -> list[float]:
    """One burst; returns each request's TTFT (seconds from the first request's arrival)."""
    from gmlx.engine.types import GenerateRequest, SamplingParams

    # greedy, never ending early: the ends of sequence banned
    greedy = SamplingParams(temperature=0, logit_bias={t: -100.0 for t in worker.loaded.tokenizer.eos_token_ids})
    vocab = worker.vocab_size
    firsts: dict[int, float] = {}

    def read(i: int, handle: Any) -> None:
        for event in handle:
            if event.token_ids and i not in firsts:
                firsts[i] = time.perf_counter() - steps.t0

    steps.rows.clear()
    steps.t0 = time.perf_counter()
    steps.on = True
    readers = []
    for i in range(width):
        ids = tuple((seed * 7919 + 131 * i + 17 * j) % (vocab - 300) + 100 for j in range(prompt))
        handle = worker.submit(GenerateRequest(ids, max_tokens=tokens, sampling=greedy))
        reader = threading.Thread(target=read, args=(i, handle))
        reader.start()
        readers.append(reader)
        if spread:
            time.sleep(spread)
    for reader in readers:
        reader.join()
    steps.on = False
    return [firsts[i] for i in range(width)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model reference gmlx serve takes (a GGUF, a folder, demo)")
    parser.add_argument("--widths", default="8,32")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (plus the round)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spread-ms", type=float, default=2.0, help="between two requests' arrivals")
    parser.add_argument("--decode-batch", type=int, help="the worker's decode width (default: the widest burst)")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the server's warm-up")
    parser.add_argument("--all-steps", action="store_true", help="every step of a round, and the decode steps' spread")
    parser.add_argument("--dtype", default="float16", help="synthetic: float type")
    args = parser.parse_args()

    from benchmarks.gpu.served_step import load
    from gmlx.engine.kernels import prepare_layers
    from gmlx.engine.worker import ModelWorker

    steps = StepLog()
    steps.patch()
    started = time.perf_counter()
    loaded = load(args.model, args.dtype)
    notes = prepare_layers(loaded.model)
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s; {'; '.join(notes) or 'no notes'}",
          flush=True)
    widths = [int(w) for w in args.widths.split(",")]
    worker = ModelWorker(loaded, decode_batch=args.decode_batch or max(widths))
    try:
        if not args.no_warm_up:
            print(f"warm-up {worker.warm_up():.1f} s (decode batch {worker.decode_batch}, "
                  f"prefill chunk {worker.prefill_step_size})", flush=True)
        for width in widths:
            for r in range(args.rounds):
                ttfts = run_round(worker, steps, width, args.prompt + r, args.tokens, args.spread_ms / 1000,
                                  seed=1000 * width + r)
                last = max(ttfts)
                print(f"\nwidth {width} round {r} (prompts of {args.prompt + r}): TTFT p50 "
                      f"{statistics.median(ttfts) * 1000:.0f} ms, last {last * 1000:.0f} ms", flush=True)
                print(f"{'start ms':>9} {'took ms':>8}  {'prompts left':<22} {'rows':>4} {'chunk':>6} {'running':>7}")
                for t, took, left, rows, chunk, running in steps.rows:
                    if t > last and not args.all_steps:
                        break
                    print(f"{t * 1000:9.1f} {took * 1000:8.1f}  {left:<22} {rows:>4} {chunk:>6} {running:>7}")
                print("TTFT ms: " + " ".join(f"{x * 1000:.0f}" for x in ttfts), flush=True)
                decode = [(i, took) for i, (_, took, left, *_) in enumerate(steps.rows) if left == "-"]
                if args.all_steps and decode:
                    times = sorted(took for _, took in decode)
                    slowest = sorted(decode, key=lambda d: -d[1])[:5]
                    print(f"decode steps: {len(decode)}, median {statistics.median(times) * 1000:.2f} ms, "
                          f"p90 {times[int(0.9 * (len(times) - 1))] * 1000:.2f}, slowest "
                          + ", ".join(f"#{i} {took * 1000:.1f}" for i, took in slowest), flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
