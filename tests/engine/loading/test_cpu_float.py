"""On the CPU backend a quantized model's layers become floats at load, where memory
allows (MLX's CPU quantized matmul is 25-50x slower than a float one): the same
answers, float layers, and a load note saying so; too little memory keeps them."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn

from gmlx.engine.loading import load_model
from gmlx.engine.loading.cpu_float import dequantize_for_cpu, float_bytes, quantized_modules

GIB = 1 << 30


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen2-Q4_K", "gemma3_text-Q8_0"])
def test_quantized_layers_become_floats_with_the_same_logits(tiny_models, name) -> None:
    tiny = tiny_models[name]
    quantized, floats = load_model(tiny.path), load_model(tiny.path)
    layers = quantized_modules(floats.model)
    assert layers  # the GGUF's K-quant / Q4_0 / Q8_0 tensors load as MLX-quantized layers
    note = dequantize_for_cpu(floats.model, free_bytes=64 * GIB)
    assert note is not None and "dequantized" in note and "float32" in note
    assert not quantized_modules(floats.model)
    ids = mx.array([[3, 17, 42, 7, 99, 5]])
    a, b = quantized.model(ids), floats.model(ids)
    # the quantized layers compute in float16, the floats in float32: f16 rounding apart
    assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=5e-2, rtol=5e-2)
    assert mx.argmax(a, axis=-1).tolist() == mx.argmax(b, axis=-1).tolist()


def test_float16_when_float32_does_not_fit_and_kept_when_neither_does(tiny_models) -> None:
    tiny = tiny_models["llama-Q4_0"]
    model = load_model(tiny.path).model
    f32, f16 = float_bytes(model, 4), float_bytes(model, 2)
    # the quantized layers double from float16 to float32; the rest stays as stored
    assert f32 == 2 * f16 - sum(a.nbytes for a in _unquantized(model))
    kept = dequantize_for_cpu(model, free_bytes=f16)  # half of it is the budget: too small
    assert kept is not None and "kept" in kept and quantized_modules(model)
    half = dequantize_for_cpu(model, free_bytes=2 * f16 + 8)
    assert half is not None and "float16" in half and not quantized_modules(model)
    assert all(l.weight.dtype == mx.float16 for _, l in model.named_modules() if isinstance(l, nn.Linear))


def test_nothing_to_decide_for_a_float_model(tiny_models) -> None:
    assert dequantize_for_cpu(load_model(tiny_models["llama-F16"].path).model, 64 * GIB) is None


def _unquantized(model: nn.Module) -> list[mx.array]:
    from mlx.utils import tree_flatten

    quantized = {path for path, _ in quantized_modules(model)}
    return [a for path, a in tree_flatten(model.parameters()) if path.rsplit(".", 1)[0] not in quantized]
