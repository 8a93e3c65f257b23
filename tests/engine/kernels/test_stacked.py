"""A block's same-layout weights stacked into one array each (``GMLX_STACKED=1``): the
layers keep views of their rows (no memory held twice, every product unchanged), and the
one-row kernels are handed the stacked arrays where the load made them. The kernels'
stacked sources run on the CPU against MLX's products in ``test_qgemv_cuda.py``; here the
load and the wiring run through real models, with MLX's products standing in for the
kernels (CUDA cannot run here), computed from the stacked arrays themselves."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import BatchKVCache

from gmlx.engine.kernels import (
    compiled_blocks,
    cuda_source,
    glu_cuda,
    one_token,
    qgemv_cuda,
    qkv_cuda,
    stacked,
)
from tests.engine.kernels.models import one_row_kernels, steps, tiny

LAYERS = 2
PROMPT = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])


def _attach(model):
    return stacked.attach(qkv_cuda.stackable(model), glu_cuda.stackable(model))


def _model():
    model = tiny("llama", LAYERS, quantized=True, dtype=mx.bfloat16)
    assert one_token.attach(model) == LAYERS
    return model


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stacked.ENV, "1")
    monkeypatch.setattr(cuda_source, "available", lambda: True)  # (what attach asks; nothing here runs CUDA)


def test_off_unless_asked_and_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stacked.ENV, raising=False)
    assert not stacked.enabled()
    monkeypatch.setenv(stacked.ENV, "1")
    assert not stacked.enabled()  # this CPU: no CUDA
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    assert stacked.enabled()


def test_the_layers_read_views_of_the_stacked_rows_and_compute_what_they_did(on) -> None:
    model = _model()
    want = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PROMPT, n=3)
    mx.eval(model.parameters())
    before = mx.get_active_memory()
    assert _attach(model) == ("cuda: the queries, keys and values of 2 attention layer(s) and the gate and up "
                                     "of 2 MLP(s) stacked into one array each")
    assert mx.get_active_memory() <= before  # the layers' arrays are views of the stacked ones: nothing held twice
    got = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PROMPT, n=3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    w, scales, biases = stacked.of(attention, qkv_cuda.NAMES)
    layers = [attention[name] for name in qkv_cuda.NAMES]
    assert w.shape[0] == sum(layer.weight.shape[0] for layer in layers)
    start = 0
    for layer in layers:  # each layer's rows, in order
        rows = layer.weight.shape[0]
        assert mx.array_equal(layer.weight, w[start:start + rows]).item()
        assert mx.array_equal(layer.scales, scales[start:start + rows]).item()
        assert mx.array_equal(layer.biases, biases[start:start + rows]).item()
        start += rows
    assert stacked.of(mlp, stacked.GATE_UP)[0].shape[0] == 2 * mlp.gate_proj.weight.shape[0]
    assert stacked.of(attention, qkv_cuda.NAMES[:2]) is None  # not what was stacked
    mlp.up_proj.weight = mx.array(mlp.up_proj.weight)  # a layer given arrays of its own: no longer read as stacked
    assert stacked.of(mlp, stacked.GATE_UP) is None


def test_the_one_row_kernels_are_handed_the_stacked_arrays(on, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both folds at one stream (the q-k-v product's and the gate-up's) bind the stacked
    arrays; standing in, MLX's norm and products over those arrays' rows give the logits
    the model gave before, bit for bit."""
    handed: list[str] = []

    def bind(w, scales, biases, group_size, bits, config, up=None, more=(), residual=False, norm=None, heads=(),
             stacked=None):
        if not (up or more):  # a layer of its own (fast_linear's one-row path)
            def plain(x, *r):
                y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
                return r[0] + y if residual else y
            return plain
        sizes = [w.shape[0], *(m[0].shape[0] for m in ((up,) if up else more))]
        assert stacked is not None and stacked[0].shape[0] == sum(sizes)

        def run(x):
            handed.append("gated" if up else f"parts{len(sizes)}")
            n = mx.fast.rms_norm(x, norm[0], norm[1])
            outs, start = [], 0
            for rows in sizes:  # each layer's rows of the stacked arrays
                part = [a[start:start + rows] for a in stacked]
                outs.append(mx.quantized_matmul(n, *part, transpose=True, group_size=group_size, bits=bits))
                start += rows
            if up:
                return swiglu(*outs)
            shapes = cuda_source.out_shapes(x.shape[:-1], sizes, heads)
            return tuple(o.reshape(s) for o, s in zip(outs, shapes, strict=True))
        return run

    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    model = _model()
    want = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PROMPT, n=3)
    assert _attach(model) is not None
    one_row_kernels(model)
    assert glu_cuda.attach(model, glu_cuda.mlx_gated, buckets=()) == LAYERS
    assert glu_cuda.fold_norms(model).endswith(f"in {LAYERS} of {LAYERS} block(s)")
    assert qkv_cuda.fold_norms(model).endswith(f"in {LAYERS} of {LAYERS} block(s)")
    assert compiled_blocks.attach(model) == LAYERS
    handed.clear()  # (the load's checks)
    got = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PROMPT, n=3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))
    assert sorted(handed) == sorted(["gated", "parts3"] * LAYERS)  # each layer's two kernels traced once
    compiled_blocks.detach(model)
    glu_cuda.detach(model)
