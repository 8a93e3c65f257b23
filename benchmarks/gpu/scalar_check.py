"""What a decode step's few-byte arrays cost when the host and the GPU take turns at them
(the GPU machine; no model file). For issue 19's one-stream step.

MLX's CUDA allocator gives every array managed memory, and an array of 8 bytes or less
a block of a small pool advised read-mostly: each processor that reads such a page keeps
a copy of it, and a write by either invalidates the other's, a page fault on the next
access. A one-stream step writes its token (4 bytes) on the GPU and reads it on the host,
and the whole step's write position is made on the host every step (4 bytes) and read
by every layer's attention on the GPU: if each turn costs a fault, a step pays for a few.

A chain of small steps, each a gather of a row chosen by the last step's token and the
row's argmax (MLX's, then gmlx's kernel: ``argmax_cuda``), ``--steps`` of them, each
waited for; wall us a step (the median), five ways:

- ``1 row, read``: the token (4 bytes: the small pool) read on the host every step, as a
  decode step reads it;
- ``1 row, not read``: the same, waited for but never read on the host;
- ``4 rows, read``: four tokens (16 bytes: a block of managed memory of its own);
- ``1 row, read, a position made on the host``: and every step an ``int32`` array of one
  made on the host and added into the gather's index on the GPU, as the step's write
  position is;
- ``1 row, read, the position kept on the GPU``: the position advanced on the GPU
  (``position + 1``), never made on the host.

Where ``read`` costs tens of us more than ``not read`` (the small pool's faults), the
step's token and position are worth keeping out of the pool.

    python benchmarks/gpu/scalar_check.py [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gmlx.engine.kernels import argmax_cuda, cuda_source

VOCAB = 128256
TABLE_ROWS = 64


def chain(argmax, rows: int, steps: int, read: bool, position: str = "") -> float:
    """The median wall seconds a step of the chain (see the module's docstring)."""
    table = mx.random.normal((TABLE_ROWS, VOCAB), key=mx.random.key(1)).astype(mx.float16)
    tok = mx.zeros((rows,), mx.uint32)
    at = mx.zeros((1,), mx.int32)
    mx.eval(table, tok, at)
    took = []
    for i in range(steps + 10):
        start = time.perf_counter()
        index = tok.astype(mx.int32) % TABLE_ROWS
        if position == "host":
            index = (index + mx.array([i], mx.int32) * 0) % TABLE_ROWS
        elif position == "gpu":
            at = at + 1
            index = (index + at * 0) % TABLE_ROWS
        tok = argmax(table[index])
        mx.eval(tok, at)
        if read:
            tok.tolist()
        took.append(time.perf_counter() - start)
    return statistics.median(took[10:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    if not cuda_source.available():
        sys.exit("scalar_check: the small pool is CUDA's (run it on the GPU machine)")
    print(f"device {mx.default_device()}; {args.steps} steps a way, wall us a step (median)")
    forms = {"MLX's argmax": lambda x: mx.argmax(x, axis=-1).astype(mx.uint32)}
    if argmax_cuda.check() is not None and argmax_cuda.agrees():
        forms["gmlx's argmax kernel"] = argmax_cuda.argmax
    ways = [("1 row, read", 1, True, ""), ("1 row, not read", 1, False, ""), ("4 rows, read", 4, True, ""),
            ("1 row, read, a position made on the host", 1, True, "host"),
            ("1 row, read, the position kept on the GPU", 1, True, "gpu")]
    print("| way | " + " | ".join(forms) + " |")
    print("|---|" + "---:|" * len(forms))
    for name, rows, read, position in ways:
        cells = [f"{chain(fn, rows, args.steps, read, position) * 1e6:.1f}" for fn in forms.values()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
