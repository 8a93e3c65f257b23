"""Whole decode steps of a quantized model with and without the decode-sized paths, in
one process: what ``fast_linear`` chose per row bucket, the whole-step speed-up it
measured while choosing, and the steps timed again afterwards.

Random weights of a real shape in MLX's affine layouts as a Q4_K_M GGUF loads (4-bit
group 32; 6-bit group 32 for the output layer and, in the layers llama.cpp gives more
bits, ``v_proj`` and ``down_proj``), built in memory: no model files needed, so it runs
right after ``setup.sh install``. Rows past 64 are a prefill of one prompt that long.

    python benchmarks/gpu/step_check.py [--shape llama3-8b] [--rows 1,8,32]
    python benchmarks/gpu/step_check.py --shape tiny   # here, on the CPU (no paths apply)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_throughput import SHAPES
from gmlx.engine.kernels import fast_linear, timing


def build(shape: str, dtype: str = "bfloat16", quantize: bool = True) -> nn.Module:
    from mlx_lm.models import llama

    s = SHAPES[shape]
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False, **s)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(getattr(mx, dtype))
    n = args.num_hidden_layers
    if not quantize:  # the float model (an MLX bf16 folder's layers)
        mx.eval(model.parameters())
        return model

    def six_bits(path: str) -> bool:  # llama.cpp's Q4_K_M: more bits in some layers
        if path == "lm_head":
            return True
        if not path.endswith(("v_proj", "down_proj")):
            return False
        i = int(path.split(".")[2])
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    nn.quantize(model, group_size=32, bits=6,
                class_predicate=lambda path, m: isinstance(m, nn.Linear) and six_bits(path))
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda path, m: isinstance(m, nn.Linear))
    mx.eval(model.parameters())
    return model


def steps(model: nn.Module, rows: list[int]) -> dict[int, float]:
    """Milliseconds per decode step (each waited for) at each row count; past 64 rows,
    per prefill of a prompt that long."""
    return {r: timing.step_time(model, r, context=128, steps=16) * 1e3 for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8,32,64,512")
    parser.add_argument("--no-tune", action="store_true", help="MLX's paths only (2-D and 3-D x)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    t = time.perf_counter()
    model = build(args.shape)
    print(f"{args.shape}: built and quantized in {time.perf_counter() - t:.1f} s on {mx.default_device()}",
          flush=True)
    before = steps(model, rows)
    print("MLX's product, ms/step: " + ", ".join(f"{r} rows {ms:.2f}" for r, ms in before.items()), flush=True)
    if args.no_tune:  # the same products with x as (rows, K): what MLX does with a 2-D input
        call = nn.QuantizedLinear.__call__
        nn.QuantizedLinear.__call__ = lambda self, x: call(self, x.reshape(-1, x.shape[-1])).reshape(
            *x.shape[:-1], -1)
        flat = steps(model, rows)
        print("MLX's product, x flattened, ms/step: " + ", ".join(
            f"{r} rows {ms:.2f}" for r, ms in flat.items()), flush=True)
        return
    t = time.perf_counter()
    note = fast_linear.use_fast_kernels(model)
    print(f"tuner: {time.perf_counter() - t:.1f} s; {note}", flush=True)
    after = steps(model, rows)
    print("| rows | MLX ms/step | chosen paths ms/step | speed-up | tok/s chosen |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r} | {before[r]:.2f} | {after[r]:.2f} | {before[r] / after[r]:.2f}x | "
              f"{r / after[r] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
