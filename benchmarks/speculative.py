"""Speculative decoding against the same model undrafted, in one run.

Prints decode tokens per second (generated tokens over the time from each request's
first token to its last, greedy) for:

- the target as its own drafter (full acceptance) at widths 1 and 4;
- a random-weights drafter of the same vocabulary (zero acceptance): the cost;
- prompt lookup on an edit-style prompt that repeats its text.

    python benchmarks/speculative.py [--model demo] [--tokens 160] [--draft-tokens 4]

On the built-in ``demo`` model this runs on a CPU in under a minute; with a real model
(``--model PATH``) the same-weights drafter doubles the weights read per round, so its
"full acceptance" row is an upper bound on what a small drafter reaches.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx.utils import tree_map

from gmlx.engine.drafting import DraftSpec
from gmlx.engine.loading import load_model
from gmlx.engine.speculative import Speculation, load_speculation
from gmlx.engine.types import GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker

PROMPTS = ["Hello, world! How are you", "def main(argv", "The quick brown fox", "SELECT id, name FROM users"]
EDIT = ("Rename total to subtotal in this function and return it unchanged otherwise:\n"
        "def price(items):\n    total = 0\n    for item in items:\n        total += item.cost * item.count\n"
        "    return total\n\ndef price(items):\n    subtotal = 0\n    for item in items:\n")


def decode_rate(worker: ModelWorker, prompts: list[str], tokens: int) -> float:
    """Aggregate decode tokens/s of ``prompts`` run together (greedy), from the first
    token any of them got to the end."""
    tok = worker.loaded.tokenizer
    greedy = SamplingParams(temperature=0.0)
    handles = [worker.submit(GenerateRequest(tuple(tok.encode(p)), max_tokens=tokens, sampling=greedy))
               for p in prompts]
    first: float | None = None
    counted = 0
    for h in handles:
        for event in h:
            if event.token_ids and first is None:
                first = time.perf_counter()
            counted += len(event.token_ids)
    elapsed = time.perf_counter() - (first or time.perf_counter())
    return counted / elapsed if elapsed > 0 else 0.0


def random_drafter(source: str, draft_tokens: int) -> Speculation:
    draft = load_model(source)
    model = draft.model
    mx.random.seed(7)
    model.update(tree_map(lambda p: mx.random.normal(p.shape).astype(p.dtype) * 0.5, model.parameters()))
    mx.eval(model.parameters())
    return Speculation(DraftSpec(draft_source="random", draft_tokens=draft_tokens), draft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    loaded = load_model(args.model)
    k = args.draft_tokens
    drafters = {
        "none": None,
        "self (full acceptance)": load_speculation(DraftSpec(draft_source=args.model, draft_tokens=k), loaded),
        "random (zero acceptance)": random_drafter(args.model, k),
        "prompt lookup": load_speculation(DraftSpec(prompt_lookup=True, draft_tokens=k), loaded),
    }
    cases = [("self (full acceptance)", PROMPTS[:1], 1), ("self (full acceptance)", PROMPTS, 4),
             ("random (zero acceptance)", PROMPTS[:1], 1), ("random (zero acceptance)", PROMPTS, 4),
             ("prompt lookup", [EDIT], 1)]
    workers = {name: ModelWorker(loaded, decode_batch=4, speculation=s) for name, s in drafters.items()}
    try:
        for w in workers.values():  # compile and warm the shapes once
            decode_rate(w, PROMPTS, 16)
        print(f"model {args.model}, {args.tokens} tokens a stream, {k} drafted a round, greedy")
        print(f"{'drafter':<26}{'width':>6}{'prompt':>8}{'base tok/s':>12}{'drafted tok/s':>15}{'speed-up':>10}")
        for name, prompts, width in cases:
            kind = "edit" if prompts == [EDIT] else "chat"
            base = decode_rate(workers["none"], prompts, args.tokens)
            drafted = decode_rate(workers[name], prompts, args.tokens)
            print(f"{name:<26}{width:>6}{kind:>8}{base:>12.1f}{drafted:>15.1f}{drafted / base:>9.2f}x")
    finally:
        for w in workers.values():
            w.close()


if __name__ == "__main__":
    main()
