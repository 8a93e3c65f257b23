"""How much of its pace a Python thread keeps while another thread tokenizes a long chat
prompt: with gmlx's prefix-reusing encoder (which tokenizes through ``encode_batch`` and
lets go of the GIL) against the Rust tokenizer's ``encode`` (which holds it throughout).

    python benchmarks/tokenize_gil.py              # the demo model's tokenizer, 5 tries
    python benchmarks/tokenize_gil.py --turns 3000 --tries 9

A spinning thread counts iterations while a tokenizing thread encodes the prompt three
times; prints the spinner's iterations per second beside each (the best of ``--tries``
interleaved tries, so a change in the machine's load falls on both), alone as a
reference, and the ratio ours / holding. The test suite checks only that the GIL is
released (tests/engine/test_tokenizer.py); the figure lives here.
"""

from __future__ import annotations

import argparse
import threading
import time


def spin_rate(work) -> float:
    """Iterations per second this thread makes while ``work`` runs on another thread."""
    thread = threading.Thread(target=work)
    count, start = 0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1500, help="repeats of one sentence in the prompt")
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()

    from gmlx.engine.loading import load_model
    from gmlx.engine.tokenizer import PrefixReusingEncoder

    tok = load_model("demo").tokenizer
    text = tok.render_chat([{"role": "user", "content": "a long agent history, turn after turn. " * args.turns}])
    encoder = PrefixReusingEncoder(tok._backend)
    assert encoder.encode(text) == tok._backend.encode(text, add_special_tokens=False).ids

    def ours() -> None:
        for _ in range(3):
            encoder.encode(text)

    def holding() -> None:
        for _ in range(3):
            tok._backend.encode(text, add_special_tokens=False)

    def idle() -> None:
        time.sleep(0.2)

    rates: dict[str, list[float]] = {"alone": [], "ours": [], "holding": []}
    for _ in range(args.tries):
        rates["alone"].append(spin_rate(idle))
        rates["ours"].append(spin_rate(ours))
        rates["holding"].append(spin_rate(holding))
    best = {name: max(values) for name, values in rates.items()}
    tokens = len(tok._backend.encode(text, add_special_tokens=False).ids)
    print(f"prompt: {tokens} tokens; spinner iterations/s, best of {args.tries}:")
    for name, rate in best.items():
        print(f"  {name:8s} {rate:14,.0f}  ({rate / best['alone']:.0%} of alone)")
    print(f"ours / holding: {best['ours'] / best['holding']:.1f}x")


if __name__ == "__main__":
    main()
