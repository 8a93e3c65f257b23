"""One-token steps of llama-family attention in fewer operations (``one_token``): the
same logits bit for bit as mlx-lm's own code, on single and padded batch caches, float
and quantized weights and caches; four operations fewer a layer in a decode step, none
fewer in a prompt step. Real MLX on the CPU; tiny mlx-lm models."""

from __future__ import annotations

import importlib
import re

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from gmlx.engine.kernels import one_token
from tests.engine.decoding import decode_together
from tests.engine.kernels.models import steps, tiny

LAYERS = 3


def _model(family: str, quantized: bool = False) -> nn.Module:
    return tiny(family, LAYERS, quantized=quantized)


ONE = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
CACHES = {
    # the model's own: a rotating cache on gemma3's windowed layers
    "model's own": (lambda model: make_prompt_cache(model), ONE),
    # three streams left-padded by different amounts: each step carries a mask
    "padded batch": (lambda model: [BatchKVCache([0, 3, 5]) for _ in range(LAYERS)],
                     mx.array([[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0, 7, 7, 8, 8, 9], [0, 0, 0, 0, 0, 2, 4, 6]])),
    "quantized cache": (lambda model: [QuantizedKVCache(group_size=32, bits=8) for _ in range(LAYERS)], ONE),
}


@pytest.mark.parametrize("family", one_token.FAMILIES)
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("kind", list(CACHES))
def test_the_same_logits_bit_for_bit(family: str, quantized: bool, kind: str) -> None:
    make, prompts = CACHES[kind]
    model = _model(family, quantized)
    want = steps(model, make(model), prompts)
    names = [k for k, _ in nn.utils.tree_flatten(model.parameters())]
    assert one_token.attach(model) == LAYERS
    got = steps(model, make(model), prompts)
    assert [k for k, _ in nn.utils.tree_flatten(model.parameters())] == names  # nothing moved
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.shape == b.shape
        assert mx.array_equal(a, b).item(), f"{family} {kind}: step {step} differs"


def _operations(model: nn.Module, tokens: mx.array, tmp_path) -> int:
    """The operations of one forward pass's graph after an 8-token prompt."""
    cache = [KVCache() for _ in range(LAYERS)]
    mx.eval(model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), cache=cache))
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), model(tokens, cache=cache))
    return len(re.findall(r"shape=rectangle", path.read_text()))


@pytest.mark.parametrize("family", one_token.FAMILIES)
def test_four_operations_fewer_a_layer_in_a_decode_step_only(family: str, tmp_path) -> None:
    model = _model(family)
    decode, prompt = mx.array([[7]]), mx.array([[7, 8, 9]])
    before = _operations(model, decode, tmp_path), _operations(model, prompt, tmp_path)
    one_token.attach(model)
    after = _operations(model, decode, tmp_path), _operations(model, prompt, tmp_path)
    assert before[0] - after[0] == 4 * LAYERS
    assert after[1] == before[1]  # a prompt step runs the model's own code
    one_token.detach(model)
    assert _operations(model, decode, tmp_path) == before[0]
    assert {type(layer.self_attn) for layer in model.layers} == {importlib.import_module(
        f"mlx_lm.models.{family}").Attention}


def test_turned_off_leaves_the_model_as_mlx_lm_wrote_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.models import llama

    monkeypatch.setenv(one_token.ENV, "0")
    model = _model("llama")
    assert one_token.attach(model) == 0
    assert {type(layer.self_attn) for layer in model.layers} == {llama.Attention}


def test_other_families_are_left_alone() -> None:
    """olmo2 norms its projections before the reshape (over every head at once): not the
    pattern, so its attention keeps its own code."""
    module = importlib.import_module("mlx_lm.models.olmo2")
    args = module.ModelArgs(model_type="olmo2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256)
    model = module.Model(args)
    assert one_token.attach(model) == 0
    assert {type(layer.self_attn) for layer in model.layers} == {module.Attention}


@pytest.mark.parametrize("family", one_token.FAMILIES)
def test_the_same_tokens_through_mlx_lm_generator(family: str) -> None:
    """Three prompts of different lengths decoded together by mlx-lm's BatchGenerator (a
    padded batch on its own batch caches, gemma3's rotating ones among them), greedy."""
    model = _model(family, quantized=True)
    want = decode_together(model, 10_000)  # a stop token never drawn: 24 tokens each
    one_token.attach(model)
    assert decode_together(model, 10_000) == want
    assert sorted(len(tokens) for tokens in want.values()) == [24, 24, 24]
