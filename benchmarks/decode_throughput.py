"""Batched decode throughput: gmlx's worker against mlx-lm's BatchGenerator driven
directly (the peer: the same engine with no server-side bookkeeping), in one run.

    python benchmarks/decode_throughput.py                       # tiny model, CPU-friendly
    python benchmarks/decode_throughput.py --shape llama3-8b     # on an accelerator

Random weights of a real shape measure speed honestly: decode speed does not depend
on the weights' values. Prints one row per batch width with tokens/s for both and
their ratio (gmlx / peer; 1.0 means no overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from dataclasses import replace

import mlx.core as mx

SHAPES = {
    # steps of a millisecond or so on a CPU: the worker's own per-step work shows, as it
    # does on an accelerator at an 8B's step rate
    "micro": {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8192},
    # an 8B's 32 blocks at a toy width: a step's host work (its graph built and handed
    # over, block by block) with little arithmetic, as a few streams' step on a GPU
    "narrow32": {"hidden_size": 128, "num_hidden_layers": 32, "intermediate_size": 256,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 704,
             "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 8192},
    "llama3-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
}


def build(shape: str, dtype: str):
    from gmlx.engine.loading import load_model
    from gmlx.engine.mlxlm import model_classes

    demo = load_model("demo")  # its tokenizer; prompts use ids it knows
    config = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  tie_word_embeddings=False, **SHAPES[shape])
    model_cls, args_cls = model_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return replace(demo, id=shape, model=model, config=config, context_length=8192)


def prompts(width: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 700 + 3 for j in range(length)] for i in range(width)]


def run_peer(loaded, width: int, prompt_len: int, tokens: int, bias: dict[int, float] | None = None) -> float:
    """Decode tokens/s of mlx-lm's BatchGenerator, all prompts inserted at once (with
    ``bias`` as every request's logit bias, through mlx-lm's own processor)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    gen = BatchGenerator(loaded.model, stop_tokens=[], completion_batch_size=width, prefill_batch_size=width)
    processors = [make_logits_processors(logit_bias=bias) for _ in range(width)] if bias else None
    gen.insert(prompts(width, prompt_len), max_tokens=[tokens] * width, logits_processors=processors)
    done, produced, start = 0, 0, None
    while done < width:
        _, responses = gen.next()
        if responses and start is None:
            start, produced = time.perf_counter(), 0  # time decode only, from the first token
        produced += len(responses)
        done += sum(r.finish_reason is not None for r in responses)
    elapsed = time.perf_counter() - start
    gen.close()
    return (produced - width) / elapsed


def run_peer_in_thread(loaded, width: int, prompt_len: int, tokens: int) -> float:
    """The peer loop on a thread of its own: separates the cost of running MLX off the
    main thread from the cost of gmlx's own per-token work."""
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(run_peer(loaded, width, prompt_len, tokens)))
    thread.start()
    thread.join()
    return result[0]


def worker_ttft(worker, tokens: list[int], max_tokens: int) -> float:
    """Seconds from submitting a greedy request of ``tokens`` to ``worker`` (a
    ModelWorker) to its first token. The request is read to its end, as a client does,
    so the next one does not arrive while this one still decodes."""
    from gmlx.engine.types import GenerateRequest, SamplingParams

    start, first = time.perf_counter(), None
    for ev in worker.submit(GenerateRequest(tuple(tokens), max_tokens=max_tokens,
                                            sampling=SamplingParams(temperature=0))):
        if ev.token_ids and first is None:
            first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the request produced no token")
    return first


def run_gmlx(loaded, width: int, prompt_len: int, tokens: int, bias: dict[int, float] | None = None,
             readers: str = "loop") -> float:
    """Decode tokens/s of gmlx's ModelWorker with ``width`` concurrent requests (each
    with ``bias`` as its logit bias). ``readers="loop"`` reads them as the server does:
    submitted from one event loop and read there, so a step's events wake that loop
    once; ``"threads"``: one blocking reader thread per stream, each woken per token."""
    from gmlx.engine.types import GenerateRequest, SamplingParams
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(loaded, decode_batch=width, prompt_cache_bytes=0)
    sampling = SamplingParams(temperature=0, logit_bias=bias)
    requests = [GenerateRequest(tuple(p), max_tokens=tokens, sampling=sampling) for p in prompts(width, prompt_len)]
    stamps: list[list[float]] = [[] for _ in range(width)]
    try:
        if readers == "loop":
            asyncio.run(_read_on_a_loop(worker, requests, stamps))
        else:
            handles = [worker.submit(r) for r in requests]

            def consume(i: int) -> None:
                for ev in handles[i]:
                    if ev.token_ids:
                        stamps[i].append(time.perf_counter())

            threads = [threading.Thread(target=consume, args=(i,)) for i in range(width)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        worker.close()
    # Count only what was decoded while every stream was decoding: prefill admits
    # prompts over several steps, so the streams start (and end) a few steps apart. The
    # last stream's first token is handed out by the step that ended its prompt; the
    # step after merges it into the decoding batch (its caches copied into new arrays:
    # 44-66 ms on an H200 where a step takes ~10), so the window opens at its second
    # token, as the peer's opens after its one merge. With 64 tokens a request at 32
    # streams that one step was a seventh of the window.
    start = max(s[1] for s in stamps)
    end = min(s[-1] for s in stamps)
    return sum(start < t <= end for s in stamps for t in s) / (end - start)


async def _read_on_a_loop(worker, requests: list, stamps: list[list[float]]) -> None:
    handles = [worker.submit(r) for r in requests]  # submitted on the loop: its mailbox

    async def consume(i: int) -> None:
        async for ev in handles[i]:
            if ev.token_ids:
                stamps[i].append(time.perf_counter())

    await asyncio.gather(*(consume(i) for i in range(len(handles))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--readers", choices=("loop", "threads"), default="loop",
                        help="gmlx's streams read on one event loop, as the server does, or one thread each")
    parser.add_argument("--threaded-peer", action="store_true",
                        help="also time the peer loop on its own thread (diagnoses threading costs)")
    args = parser.parse_args()

    loaded = build(args.shape, args.dtype)
    print(f"device: {mx.default_device()}  shape: {args.shape}  dtype: {args.dtype}  "
          f"prompt: {args.prompt}  tokens: {args.tokens}")
    run_peer(loaded, 1, 8, 8)  # warm up kernels for both
    run_gmlx(loaded, 1, 8, 8)
    extra = f" {'peer-thread':>12}" if args.threaded_peer else ""
    print(f"{'width':>5} {'mlx-lm tok/s':>13} {'gmlx tok/s':>11} {'ratio':>6}{extra}")
    for width in (int(w) for w in args.widths.split(",")):
        peer = run_peer(loaded, width, args.prompt, args.tokens)
        ours = run_gmlx(loaded, width, args.prompt, args.tokens, readers=args.readers)
        threaded = f" {run_peer_in_thread(loaded, width, args.prompt, args.tokens):>12.1f}" if args.threaded_peer else ""
        print(f"{width:>5} {peer:>13.1f} {ours:>11.1f} {ours / peer:>6.2f}{threaded}")


if __name__ == "__main__":
    main()
