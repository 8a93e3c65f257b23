"""GGUF -> MLX conversion speed: the previous single-threaded ``gguf_quant`` (frozen
in tests/engine/loading/test_gguf_quant_speed.py) against the current one, in one run.

    python benchmarks/convert_speed.py [--gguf PATH] [--layers 4] [--dtype float16] [--repeat 3]

Without ``--gguf`` it writes a Q4_K_M-like test GGUF (hidden 256, a 151,936-token
vocabulary: Q4_K embedding, Q6_K output, Q6_K attn_v/ffn_down on half the layers).
Prints old/new seconds per tensor type (each tensor converted ``--repeat`` times by each,
alternating, the fastest counted) and the total ratio; checks outputs are equal.

``--device`` compares instead the host path (numpy on a thread pool, "old") with the
conversion as MLX operations on the default device ("new", ``gguf_quant_mx``: what a GPU
uses), on this machine's MLX backend; on CUDA or Metal it is the check that both give the
same bytes there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine" / "loading"))
import test_gguf_quant_speed as reference
from conftest import random_blocks

from gmlx.engine.loading import gguf_quant, gguf_quant_mx

Q = GGMLQuantizationType


def build(path: Path, layers: int, hidden: int = 256, vocab: int = 151936) -> None:
    ffn, kv = 4 * hidden, hidden // 4
    spec = [("token_embd.weight", Q.Q4_K, vocab, hidden), ("output.weight", Q.Q6_K, vocab, hidden)]
    for i in range(layers):
        big = Q.Q6_K if i % 2 == 0 else Q.Q4_K
        spec += [
            (f"blk.{i}.attn_q.weight", Q.Q4_K, hidden, hidden),
            (f"blk.{i}.attn_k.weight", Q.Q4_K, kv, hidden),
            (f"blk.{i}.attn_v.weight", big, kv, hidden),
            (f"blk.{i}.attn_output.weight", Q.Q4_K, hidden, hidden),
            (f"blk.{i}.ffn_gate.weight", Q.Q4_K, ffn, hidden),
            (f"blk.{i}.ffn_up.weight", Q.Q4_K, ffn, hidden),
            (f"blk.{i}.ffn_down.weight", big, hidden, ffn),
        ]
    w = GGUFWriter(str(path), "llama")
    for n, (name, qtype, rows, cols) in enumerate(spec):
        raw = random_blocks(qtype, rows, cols, seed=n)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensors(path: Path) -> list[tuple[str, Q, np.ndarray]]:
    out = []
    for t in GGUFReader(str(path)).tensors:
        qtype = Q(t.tensor_type)
        if qtype in gguf_quant.FLOAT_TYPES or len(t.shape) != 2:
            continue
        block, size = GGML_QUANT_SIZES[qtype]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        out.append((t.name, qtype, np.asarray(t.data).reshape(rows, cols // block * size)))
    return out


def timed(convert, raw: np.ndarray, qtype: Q, dtype: mx.Dtype):
    start = time.perf_counter()
    value = convert(raw, qtype, dtype)
    mx.eval(value.weight if isinstance(value, gguf_quant.QuantizedTensor) else value)
    return time.perf_counter() - start, value


def _forced(device: bool):
    """``gguf_quant.convert`` on the device path (``device``) or the host path."""

    def convert(raw: np.ndarray, qtype: Q, dtype: mx.Dtype):
        wanted = gguf_quant_mx.wanted
        gguf_quant_mx.wanted = lambda: device
        try:
            return gguf_quant.convert(raw, qtype, dtype)
        finally:
            gguf_quant_mx.wanted = wanted

    return convert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=3,
                    help="conversions of each tensor by each converter, alternating; the fastest counts "
                         "(on a shared machine the slowest runs measure the neighbours)")
    ap.add_argument("--device", action="store_true",
                    help=f"old = the host path, new = the MLX path on the default device ({mx.default_device()})")
    ap.add_argument("--tensors", type=int, help="only the first N quantized 2-D tensors of the file")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    old_convert, new_convert = reference.convert, gguf_quant.convert
    if args.device:
        old_convert, new_convert = _forced(False), _forced(True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.gguf or Path(tmp) / "test.gguf"
        if args.gguf is None:
            build(path, args.layers)
        items = tensors(path)[: args.tensors]
        times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for _name, qtype, raw in items:
            t_old = t_new = float("inf")
            for _ in range(args.repeat):
                t, old = timed(old_convert, raw, qtype, dtype)
                t_old = min(t_old, t)
                t, new = timed(new_convert, raw, qtype, dtype)
                t_new = min(t_new, t)
            reference.assert_identical(new, old)
            row = times[qtype.name]
            row[0] += t_old
            row[1] += t_new
            row[2] += raw.shape[0] * raw.shape[1]
    labels = ("host s", "device s") if args.device else ("old s", "new s")
    print(f"{'type':<8}{'MB':>8}{labels[0]:>10}{labels[1]:>10}{'ratio':>8}   ({mx.default_device()})")
    total_old = total_new = 0.0
    for name, (t_old, t_new, nbytes) in sorted(times.items()):
        total_old, total_new = total_old + t_old, total_new + t_new
        print(f"{name:<8}{nbytes / 1e6:>8.1f}{t_old:>10.3f}{t_new:>10.3f}{t_old / t_new:>7.1f}x")
    print(f"{'total':<8}{'':>8}{total_old:>10.3f}{total_new:>10.3f}{total_old / total_new:>7.1f}x")
    print("outputs identical (weight/scales/biases bytes, max_error)")


if __name__ == "__main__":
    main()
