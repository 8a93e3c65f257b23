"""Quantized and float16 weights as bfloat16 on the CPU backend, where memory allows.

MLX's CPU backend runs a quantized matmul far slower than a float one: on a 2-core
x86 machine a 4-bit [6144 x 2048] product took 877 ms for one row against 32 ms in
float32 (28x), and 43-47x at 8 and 32 rows. A quantized model is therefore all but
unusable on a Linux CPU build, while the same model dequantized runs at float speed.
Of the float types, bfloat16 measured fastest there at every size, in half float32's
memory (``benchmarks/cpu_quantized.py --dtypes``, hidden 1024, 8 layers: decoding 9.4 /
20.5 / 28.1 tok/s at 1 / 4 / 16 streams against float32's 5.9 / 7.5 / 10.2 and
float16's 3.6 / 9.9 / 17.1; a 256-token prefill 9.4 s against 25.2 and 16.1). So, on the CPU backend
only, a loaded model's quantized layers are dequantized once at load and the whole
model (a float16 model too) computes in bfloat16, where its weights fit the memory
budget the caller gives (a share of the free memory); else the quantized layers are
kept. The load notes say which. bfloat16 is what Metal runs such models in; a float16
weight loses the three low bits of its mantissa (none, for a model trained in
bfloat16 and stored as float16). Float32 models are left as they are. Metal and CUDA
keep quantized layers: there they are the fast path.
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
    """On the CPU backend, make ``model`` compute in bfloat16: its quantized layers
    dequantized in place (when their bfloat16 weights fit ``SHARE_OF_FREE`` of
    ``free_bytes``), its float parameters cast. Returns the load note (what was done,
    or why not); None when there is nothing to decide (not the CPU backend, or neither
    quantized layers nor float16 weights)."""
    import mlx.core as mx

    from gmlx.engine.capacity import backend, human, weight_bytes

    if backend() != "cpu":
        return None
    layers = quantized_modules(model)
    halves = any(a.dtype == mx.float16 for _, a in tree_flatten(model.parameters()))
    if not layers and not halves:
        return None
    if layers:
        need = float_bytes(model, mx.bfloat16.size)
        budget = int((free_bytes or 0) * SHARE_OF_FREE)
        if need > budget:
            return (f"cpu: kept {len(layers)} quantized layer(s): as bfloat16 the weights would need "
                    f"{human(need)}, over half the free memory ({human(budget * 2)}); expect slow decoding")
    to_float(model, mx.bfloat16)
    done = f"dequantized {len(layers)} quantized layer(s) to bfloat16" if layers else "float16 weights as bfloat16"
    return (f"cpu: {done} at load ({human(weight_bytes(model))} of weights; on MLX's CPU "
            "backend bfloat16 products run fastest, quantized ones 25-50x slower)")


def to_float(model: nn.Module, dtype: Any) -> None:
    """``model`` computing in ``dtype``: its quantized layers dequantized in place and
    every float parameter cast (a float32 norm left as it is would turn the activations
    float32), evaluated on the calling thread (a worker cannot evaluate a graph another
    thread built)."""
    import mlx.core as mx

    if layers := quantized_modules(model):
        model.update_modules(tree_unflatten([(path, _as_float(m, dtype)) for path, m in layers]))
    model.set_dtype(dtype)
    mx.eval(model.parameters())


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
