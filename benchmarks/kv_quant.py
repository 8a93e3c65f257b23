"""KV-cache quantization against full-precision KV, on one model in one run.

For full precision and the uniform scheme at 8 and 4 bits: the KV bytes one token
costs (the capacity model's figure, which the tests hold to MLX's active memory), the
decode speed of one stream after a prompt, and the greedy agreement with full
precision over 256 generated tokens (the fraction of positions whose token is the
same; after the first difference the texts usually part for good, so the first
difference's position is printed too).

    python benchmarks/kv_quant.py [--model demo] [--prompt 1024] [--tokens 256] [--group 32]
"""

from __future__ import annotations

import argparse
import time

from gmlx.engine import capacity
from gmlx.engine.kv_quant import KVQuant
from gmlx.engine.loading import load_model
from gmlx.engine.types import GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker


def run(loaded, kvq: KVQuant | None, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``prompt`` and the decode rate (tokens after the first, per s)."""
    worker = ModelWorker(loaded, decode_batch=1, prompt_cache_bytes=0, kv_quant=kvq)
    try:
        req = GenerateRequest(tuple(prompt), max_tokens=tokens, sampling=SamplingParams(temperature=0))
        list(worker.generate(GenerateRequest(tuple(prompt[:64]), max_tokens=8,
                                             sampling=SamplingParams(temperature=0))))  # warm up
        out: list[int] = []
        first = 0.0
        for event in worker.generate(req):
            if event.token_ids and not out:
                first = time.perf_counter()
            out += list(event.token_ids or ())
        rate = (len(out) - 1) / (time.perf_counter() - first) if len(out) > 1 else 0.0
        return out, rate
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=256, help="generated tokens compared")
    parser.add_argument("--group", type=int, default=32, help="group size (the demo's heads are 32 wide)")
    args = parser.parse_args()

    loaded = load_model(args.model)
    vocab = int(loaded.config.get("vocab_size") or len(loaded.tokenizer))
    prompt = [(i * 7919) % (vocab - 10) + 3 for i in range(args.prompt)]
    print(f"model {args.model} ({capacity.backend()}), prompt {args.prompt} tokens, "
          f"{args.tokens} generated, group {args.group}")
    print(f"{'kv':<10}{'bytes/token':>12}{'vs fp':>8}{'decode tok/s':>14}{'agreement':>11}{'first differs':>15}")
    reference: list[int] = []
    base_bytes = 0
    for name, kvq in (("fp", None), ("fp again", None), ("8-bit", KVQuant("uniform", 8, args.group)),
                      ("4-bit", KVQuant("uniform", 4, args.group))):
        per = capacity.probe_geometry(loaded, kvq).kv_bytes_per_token
        out, rate = run(loaded, kvq, prompt, args.tokens)
        if not reference:  # "fp again": how far full precision agrees with itself
            reference, base_bytes = out, per
        same = sum(a == b for a, b in zip(out, reference)) / max(1, len(reference))
        differs = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), None)
        print(f"{name:<10}{per:>12}{base_bytes / per:>7.2f}x{rate:>14.1f}{same:>11.3f}"
              f"{'never' if differs is None else f'token {differs}':>15}")


if __name__ == "__main__":
    main()
