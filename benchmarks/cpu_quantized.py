"""What a Linux CPU user gets from a quantized model: decode speed with MLX's quantized
layers (the peer: the model as loaded) against the same model dequantized at load (what
gmlx does on the CPU backend where memory allows), in one run.

    python benchmarks/cpu_quantized.py                     # hidden 1024, 8 layers, 4-bit
    python benchmarks/cpu_quantized.py --bits 8 --hidden 512

Random weights of the given shape, quantized with MLX's affine quantization (the layout
GGUF Q4_0/Q4_K/Q8_0 tensors load into). Prints tokens/s at widths 1 and 4 for both and
the ratio (float / quantized). ``--dtypes float32,float16,bfloat16`` instead compares the
float types the layers could be dequantized to (the whole model cast): tokens/s at
widths 1, 4 and 16 and a 256-token prefill, for the choice ``gmlx.engine.loading.cpu_float``
makes.
"""

from __future__ import annotations

import argparse
import copy
import time

import mlx.core as mx
from mlx import nn


def build(hidden: int, layers: int, bits: int):
    from gmlx.engine.mlxlm import model_classes

    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": hidden * 3, "num_attention_heads": hidden // 64,
              "num_key_value_heads": max(1, hidden // 256), "vocab_size": 32000,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    model_cls, args_cls = model_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


def decode_tok_s(model, width: int, tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=width, prefill_batch_size=width)
    gen.insert([[(7 * i + j) % 1000 + 3 for j in range(32)] for i in range(width)],
               max_tokens=[tokens] * width)
    produced, start, done = 0, None, 0
    while done < width:
        _, responses = gen.next()
        if responses and start is None:
            start = time.perf_counter()
            continue
        produced += len(responses)
        done += sum(r.finish_reason is not None for r in responses)
    gen.close()
    return produced / (time.perf_counter() - start)


def compare_dtypes(quantized, names: list[str], tokens: int) -> None:
    from gmlx.engine.loading.cpu_float import to_float

    mx.set_default_device(mx.cpu)
    print(f"{'dtype':>9} {'prefill 256 ms':>15} {'w1 tok/s':>9} {'w4 tok/s':>9} {'w16 tok/s':>10}")
    for name in names:
        dtype = getattr(mx, name)
        model = copy.deepcopy(quantized)
        to_float(model, dtype)
        prompt = mx.array([[(7 * j) % 1000 + 3 for j in range(256)]])
        mx.eval(model(prompt))
        start = time.perf_counter()
        mx.eval(model(prompt))
        prefill = time.perf_counter() - start
        rates = [decode_tok_s(model, width, tokens) for width in (1, 4, 16)]
        print(f"{name:>9} {prefill * 1e3:>15.0f} " + " ".join(f"{r:>9.1f}" for r in rates), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--dtypes", help="compare these float types instead (e.g. float32,float16,bfloat16)")
    args = parser.parse_args()
    if args.dtypes:
        compare_dtypes(build(args.hidden, args.layers, args.bits), args.dtypes.split(","), args.tokens)
        return

    from gmlx.engine.loading.cpu_float import dequantize_for_cpu

    mx.set_default_device(mx.cpu)
    quantized = build(args.hidden, args.layers, args.bits)
    floats = copy.deepcopy(quantized)
    note = dequantize_for_cpu(floats, free_bytes=1 << 40)
    print(f"llama, hidden {args.hidden}, {args.layers} layers, {args.bits}-bit: {note}")
    print(f"{'width':>5} {'quantized tok/s':>16} {'float tok/s':>12} {'float/quantized':>16}")
    for width in (1, 4):
        q = decode_tok_s(quantized, width, args.tokens)
        f = decode_tok_s(floats, width, args.tokens)
        print(f"{width:>5} {q:>16.1f} {f:>12.1f} {f / q:>15.1f}x")


if __name__ == "__main__":
    main()
