"""How fast a converted-weights cache entry (a safetensors file) becomes MLX arrays on
this device, three ways, in one run: the file's bytes alone (the page cache's speed),
``mx.load`` + ``mx.eval`` (what ``convert_cache`` does) and a numpy memory map of each
tensor handed to ``mx.array``.

    python benchmarks/gpu/read_check.py /tmp/gmlx-home/cache/converted/KEY.safetensors

On the H200 an 8B Q4_K_M entry (4.6 GB) took ~18 s to load from the cache although the
file sat in the page cache: ~250 MB/s. Each way runs ``--repeat`` times, alternating; the
best is printed with its GB/s.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

# safetensors dtype names -> numpy dtypes (bf16 travels as uint16 and is viewed after)
NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "U8": np.uint8,
         "I32": np.int32, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F64": np.float64,
         "I64": np.int64, "U64": np.uint64, "BOOL": np.bool_}


def file_bytes(path: Path) -> float:
    start = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while f.read(1 << 26):
            pass
    return time.perf_counter() - start


def with_mx_load(path: Path) -> float:
    start = time.perf_counter()
    weights = mx.load(str(path))
    mx.eval(list(weights.values()))
    return time.perf_counter() - start


def with_memmap(path: Path) -> float:
    start = time.perf_counter()
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    arrays = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        raw = mm[base + lo:base + hi].view(NUMPY[info["dtype"]]).reshape(info["shape"])
        a = mx.array(raw)
        arrays.append(a.view(mx.bfloat16) if info["dtype"] == "BF16" else a)
    mx.eval(arrays)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("entry", type=Path)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    gb = args.entry.stat().st_size / 1e9
    ways = {"file bytes": file_bytes, "mx.load + eval": with_mx_load, "memmap + mx.array": with_memmap}
    best = {name: float("inf") for name in ways}
    for _ in range(args.repeat):
        for name, way in ways.items():
            best[name] = min(best[name], way(args.entry))
            mx.clear_cache()
    print(f"{args.entry.name}: {gb:.2f} GB on {mx.default_device()}")
    print("| way | best s | GB/s |\n|---|---:|---:|")
    for name, t in best.items():
        print(f"| {name} | {t:.2f} | {gb / t:.2f} |")


if __name__ == "__main__":
    main()
