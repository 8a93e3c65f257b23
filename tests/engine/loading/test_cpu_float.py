"""On the CPU backend a quantized model's layers become bfloat16 at load, where memory
allows (MLX's CPU quantized matmul is 25-50x slower than a float one, and bfloat16 its
fastest float type), and a float16 model computes in bfloat16: the same answers, float
layers, and a load note saying so; too little memory keeps the quantized layers; a
float32 model is left as it is."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from gmlx.engine.loading import load_model
from gmlx.engine.loading.cpu_float import dequantize_for_cpu, float_bytes, quantized_modules

GIB = 1 << 30
IDS = mx.array([[3, 17, 42, 7, 99, 5, 61, 23, 88, 140, 9, 200, 31, 77, 150, 12]])


def _float_types(model: nn.Module) -> set:
    return {a.dtype for _, a in tree_flatten(model.parameters()) if mx.issubdtype(a.dtype, mx.floating)}


def _same_answers(a: mx.array, b: mx.array, margin: float = 0.1) -> None:
    """Logits within bfloat16's rounding of each other (the quantized layers compute in
    float16, the floats in bfloat16), and the same top token wherever ``a``'s is ahead
    of its runner-up by more than ``margin`` (a random tiny model has near ties, which
    rounding may flip either way)."""
    a, b = a.astype(mx.float32)[0], b.astype(mx.float32)[0]
    assert mx.allclose(a, b, atol=0.15, rtol=0.05)
    top2 = mx.sort(a, axis=-1)[:, -2:]
    decisive = ((top2[:, 1] - top2[:, 0]) > margin).tolist()
    assert sum(decisive) >= 3  # enough positions to mean something
    picks_a, picks_b = mx.argmax(a, axis=-1).tolist(), mx.argmax(b, axis=-1).tolist()
    assert [x for x, d in zip(picks_a, decisive) if d] == [y for y, d in zip(picks_b, decisive) if d]


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen2-Q4_K", "gemma3_text-Q8_0"])
def test_quantized_layers_become_bfloat16_with_the_same_answers(tiny_models, name) -> None:
    tiny = tiny_models[name]
    quantized, floats = load_model(tiny.path), load_model(tiny.path)
    assert quantized_modules(floats.model)  # the GGUF's K-quant / Q4_0 / Q8_0 tensors load as MLX-quantized layers
    note = dequantize_for_cpu(floats.model, free_bytes=64 * GIB)
    assert note is not None and "dequantized" in note and "bfloat16" in note
    assert not quantized_modules(floats.model)
    assert _float_types(floats.model) == {mx.bfloat16}  # the norms too: the activations stay bfloat16
    _same_answers(quantized.model(IDS), floats.model(IDS))


def test_kept_quantized_when_bfloat16_does_not_fit(tiny_models) -> None:
    model = load_model(tiny_models["llama-Q4_0"].path).model
    need = float_bytes(model, 2)
    kept = dequantize_for_cpu(model, free_bytes=need)  # half of it is the budget: too small
    assert kept is not None and "kept" in kept and quantized_modules(model)
    done = dequantize_for_cpu(model, free_bytes=2 * need)
    assert done is not None and "bfloat16" in done and not quantized_modules(model)
    assert all(l.weight.dtype == mx.bfloat16 for _, l in model.named_modules() if isinstance(l, nn.Linear))


def test_a_float16_model_computes_in_bfloat16(tiny_models) -> None:
    tiny = tiny_models["llama-F16"]
    halves, cast = load_model(tiny.path), load_model(tiny.path)
    assert mx.float16 in _float_types(cast.model)
    note = dequantize_for_cpu(cast.model, 64 * GIB)
    assert note is not None and "float16 weights as bfloat16" in note
    assert _float_types(cast.model) == {mx.bfloat16}
    _same_answers(halves.model(IDS), cast.model(IDS))


def test_nothing_to_decide_for_a_float32_model(tiny_models) -> None:
    model = load_model(tiny_models["llama-F16"].path).model
    model.set_dtype(mx.float32)
    assert dequantize_for_cpu(model, 64 * GIB) is None
    assert _float_types(model) == {mx.float32}
