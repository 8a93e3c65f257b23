"""Stacked projections (``fused``): the model computes what it computed before, one
product per group where the layouts match, its own rows where they do not or where the
parts read different inputs. Real MLX products on the CPU; tiny mlx-lm models."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn

from gmlx.engine.kernels import fused
from gmlx.engine.kernels.fused import FusedGroup, FusedPart, fuse_projections


@pytest.fixture(autouse=True)
def _stacking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_FUSE_PROJECTIONS", "1")  # off by default (see the module)


def _llama(bias: bool = False) -> nn.Module:
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=128, num_key_value_heads=2, attention_bias=bias, mlp_bias=bias)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _logits(model: nn.Module, tokens: mx.array) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(tokens, cache=cache)]
    for _ in range(3):  # decode steps after the prompt, each stream a token
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    return mx.concatenate(out, axis=1)


def _products(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Records the weight shape of every quantized product the model makes."""
    seen: list[tuple[int, ...]] = []
    real = mx.quantized_matmul

    def spy(x, w, *args, **kwargs):
        seen.append(tuple(w.shape))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return seen


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_same_logits_with_one_product_per_group(quantized: bool, bias: bool) -> None:
    model = _llama(bias)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[5, 9, 13, 2, 7], [1, 2, 3, 4, 5]])
    before = _logits(model, tokens)
    n_params = sum(v.size for _, v in nn.utils.tree_flatten(model.parameters()))
    note = fuse_projections(model)
    assert note == "stacked projections: q+k+v in 2 layer(s), gate+up in 2 layer(s)"
    attention = model.layers[0].self_attn
    assert all(isinstance(attention[n], FusedPart) for n in ("q_proj", "k_proj", "v_proj"))
    assert sum(v.size for _, v in nn.utils.tree_flatten(model.parameters())) == n_params  # stored once
    after = _logits(model, tokens)
    assert mx.allclose(before, after, atol=1e-5, rtol=1e-5)


def test_one_quantized_product_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    nn.quantize(model, group_size=32, bits=4)
    fuse_projections(model)
    seen = _products(monkeypatch)
    mx.eval(model(mx.array([[1, 2, 3]])))
    # per layer: q+k+v (64+32+32 rows), o, gate+up (2 x 128), down; then the output layer
    assert seen == [(128, 8), (64, 8), (256, 8), (64, 16)] * 2 + [(128, 8)]


def test_layouts_that_differ_stack_the_members_that_share_one() -> None:
    """A Q4_K_M GGUF's layers with more bits: a 6-bit v_proj beside 4-bit q and k."""
    model = _llama()
    nn.quantize(model, group_size=32, bits=6, class_predicate=lambda p, m: p.endswith("v_proj"))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    tokens = mx.array([[5, 9, 13, 2]])
    before = _logits(model, tokens)
    assert fuse_projections(model) == "stacked projections: q+k in 2 layer(s), gate+up in 2 layer(s)"
    attention = model.layers[1].self_attn
    assert isinstance(attention.q_proj, FusedPart) and type(attention.v_proj) is nn.QuantizedLinear
    assert mx.allclose(before, _logits(model, tokens), atol=1e-5, rtol=1e-5)


def test_parts_reading_different_inputs_compute_their_own_rows() -> None:
    """Cross-attention's keys read another input than its queries: each part then takes
    its own rows of the stacked weights, and the group stops computing the whole product."""
    layers = [nn.Linear(16, n) for n in (8, 4, 4)]
    mx.eval([m.parameters() for m in layers])
    group = FusedGroup(fused._stack(layers), [8, 4, 4])
    parts = [FusedPart(group, i, holds=i == 0) for i in range(3)]
    x, memory = mx.random.normal((2, 16)), mx.random.normal((5, 16))
    got = [parts[0](x), parts[1](memory), parts[2](memory)]
    assert group.split
    for part, layer, inp in zip(got, layers, (x, memory, memory), strict=True):
        assert mx.allclose(part, layer(inp), atol=1e-6)
    assert mx.allclose(parts[0](x), layers[0](x), atol=1e-6)  # alone from then on


def test_a_part_called_twice_with_one_input_computes_again() -> None:
    layers = [nn.Linear(16, n) for n in (8, 8)]
    mx.eval([m.parameters() for m in layers])
    group = FusedGroup(fused._stack(layers), [8, 8])
    gate, up = (FusedPart(group, i, holds=i == 0) for i in range(2))
    x = mx.random.normal((3, 16))
    assert mx.allclose(gate(x), layers[0](x)) and mx.allclose(gate(x), layers[0](x))
    assert mx.allclose(up(x), layers[1](x))
    assert group.pending.x is None and not group.split  # nothing held after the last part


@pytest.mark.parametrize("setting", [None, "0"])
def test_off_by_default_leaves_the_model_as_it_is(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    if setting is None:
        monkeypatch.delenv("GMLX_FUSE_PROJECTIONS")
    else:
        monkeypatch.setenv("GMLX_FUSE_PROJECTIONS", setting)
    model = _llama()
    assert fuse_projections(model) is None
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear


def test_the_demo_model_answers_as_before() -> None:
    """The built-in model through the loader (a qwen2: biases on q/k/v), greedy."""
    from gmlx.engine.loading import load_model

    tokens = mx.array([load_model("demo").tokenizer.encode("hello there, how are you?")])
    want = _logits(load_model("demo").model, tokens)
    stacked = load_model("demo").model
    assert fuse_projections(stacked) == "stacked projections: q+k+v in 2 layer(s), gate+up in 2 layer(s)"
    got = _logits(stacked, tokens)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)).all()


def test_a_started_model_runs_stacked(caplog: pytest.LogCaptureFixture) -> None:
    """Asked for, the engine's start stacks the projections and logs it (no load note:
    ``gmlx run`` prints those, and this changes nothing a user sees)."""
    from gmlx.engine.addressing import ModelSpec
    from gmlx.engine.governor import Governor
    from gmlx.engine.model_start import WorkerSettings, start_model

    settings = WorkerSettings(decode_batch=2, queue_cap=None, prompt_cache_bytes=None,
                              governor=Governor(lambda: 1 << 34, floor_bytes=1 << 20), warmup=False)
    with caplog.at_level("INFO", logger="gmlx.engine.kernels"):
        entry = start_model(ModelSpec(id="demo", source="demo"), settings, free_bytes=lambda: 1 << 30, now=0.0)
    try:
        loaded = entry.worker.loaded
        assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, FusedPart)
        assert "stacked projections: q+k+v in 2 layer(s), gate+up in 2 layer(s)" in caplog.messages
        assert not any("stacked" in note for note in loaded.notes)
    finally:
        entry.worker.close()
