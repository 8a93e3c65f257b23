"""Quantized weights as floats on the CPU backend, where memory allows.

MLX's CPU backend runs a quantized matmul far slower than a float one: on a 2-core
x86 machine a 4-bit [6144 x 2048] product took 877 ms for one row against 32 ms in
float32 (28x), and 43-47x at 8 and 32 rows. A quantized model is therefore all but
unusable on a Linux CPU build, while the same model dequantized runs at float speed.
So, on the CPU backend only, a loaded model's quantized layers are dequantized once at
load, into float32 where the float weights fit the memory budget the caller gives
(a share of the free memory), else float16, else left quantized; the load notes say
which. Metal and CUDA keep the quantized layers: there they are the fast path.
"""

from __future__ import annotations

from typing import Any

from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

SHARE_OF_FREE = 0.5  # the float weights may take this share of the free memory


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, m) for path, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def float_bytes(model: nn.Module, itemsize: int) -> int:
    """The model's parameter bytes once its quantized layers are floats of ``itemsize``."""
    quantized = dict(quantized_modules(model))
    total = 0
    for path, a in tree_flatten(model.parameters()):
        module, _, name = path.rpartition(".")
        if (layer := quantized.get(module)) is None:
            total += a.nbytes
        elif name == "weight":  # packed words: 32 // bits weights each
            total += a.shape[0] * a.shape[1] * 32 // layer.bits * itemsize
        elif name not in ("scales", "biases"):  # those go with the packed weight
            total += a.nbytes
    return total


def dequantize_for_cpu(model: nn.Module, free_bytes: int | None) -> str | None:
    """Dequantize ``model``'s quantized layers in place when MLX runs on the CPU and
    the float weights fit ``SHARE_OF_FREE`` of ``free_bytes``. Returns the load note
    (what was done, or why not); None when there is nothing to decide (no quantized
    layer, or not the CPU backend)."""
    import mlx.core as mx

    from gmlx.engine.capacity import backend, human

    layers = quantized_modules(model)
    if not layers or backend() != "cpu":
        return None
    budget = int((free_bytes or 0) * SHARE_OF_FREE)
    for dtype in (mx.float32, mx.float16):
        need = float_bytes(model, dtype.size)
        if need <= budget:
            model.update_modules(tree_unflatten([(path, _as_float(m, dtype)) for path, m in layers]))
            mx.eval(model.parameters())
            return (f"cpu: dequantized {len(layers)} quantized layer(s) to {str(dtype).rsplit('.', 1)[-1]} at load "
                    f"({human(need)} of weights; MLX's CPU quantized matmul is 25-50x slower)")
    need = float_bytes(model, mx.float16.size)
    return (f"cpu: kept {len(layers)} quantized layer(s): as float16 the weights would need "
            f"{human(need)}, over half the free memory ({human(budget * 2)}); expect slow decoding")


def _as_float(layer: Any, dtype: Any) -> nn.Module:
    import mlx.core as mx

    weight = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                           bits=layer.bits, mode=getattr(layer, "mode", "affine")).astype(dtype)
    if isinstance(layer, nn.QuantizedEmbedding):
        out: nn.Module = nn.Embedding(weight.shape[0], weight.shape[1])
        out.weight = weight
        return out
    bias = "bias" in layer
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    linear.weight = weight
    if bias:
        linear.bias = layer.bias.astype(dtype)
    return linear
