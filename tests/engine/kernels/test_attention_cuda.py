"""The padded batch's one-query attention kernel: its arithmetic (replayed in numpy)
against MLX's own masked attention on the CPU, which calls it takes, and its route
through mlx-lm's attention into a real model's decode step.

MLX has no CUDA backend on this machine, so the kernel itself cannot run here: its
arithmetic is replayed (``attention_cuda.replay``, the same tiles, base-2 exponents and
rescaling) and the routing tests put that replay where the kernel would be, said in each.
``benchmarks/gpu/attention_check.py`` runs the kernel itself on the H200 against MLX."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine import mlxlm
from gmlx.engine.kernels import attention_cuda


def _inputs(batch: int, heads: int, kv_heads: int, keys: int, d: int, padding: list[int], dtype=mx.float32):
    mx.random.seed(batch * 1000 + keys)
    q = mx.random.normal((batch, heads, 1, d)).astype(dtype)
    k = (mx.random.normal((batch, kv_heads, keys, d)) * 2).astype(dtype)  # wide scores: the max matters
    v = mx.random.normal((batch, kv_heads, keys, d)).astype(dtype)
    cols = mx.arange(keys)[None]
    mask = (mx.array(padding)[:, None, None, None] <= cols).reshape(batch, 1, 1, keys)
    return q, k, v, mask


@pytest.mark.parametrize("keys,padding", [(7, [0, 3, 6]), (300, [0, 17, 290]), (700, [0, 0, 520])])
def test_the_arithmetic_matches_mlx_masked_attention(keys: int, padding: list[int]) -> None:
    """One, two and three tiles of keys; a stream whose whole first tile is padding."""
    q, k, v, mask = _inputs(3, 8, 2, keys, 64, padding)
    scale = 64 ** -0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = attention_cuda.replay(np.array(q), np.array(k), np.array(v), scale, np.array(mask))
    assert np.allclose(got, np.array(want), rtol=1e-4, atol=1e-5)
    # a padded key changes nothing, whatever it holds
    k2 = mx.where(mask.transpose(0, 1, 3, 2), k, 1e4)
    again = attention_cuda.replay(np.array(q), np.array(k2), np.array(v), scale, np.array(mask))
    assert np.array_equal(got, again)


def test_which_calls_it_takes() -> None:
    q, k, v, mask = _inputs(2, 8, 2, 40, 128, [0, 5], mx.bfloat16)
    assert attention_cuda.supports(q, k, v, mask)
    assert attention_cuda.supports(q, k[..., :33, :], v[..., :33, :], mask[..., :33])  # the cache's views
    assert not attention_cuda.supports(q, k, v, None)  # unmasked: MLX's own one-query kernel
    assert not attention_cuda.supports(q, k, v, "causal")
    assert not attention_cuda.supports(q, k, v, mx.where(mask, 0.0, -1e9))  # an additive mask
    assert not attention_cuda.supports(q, k, v, mask, sinks=mx.zeros((8,)))
    assert not attention_cuda.supports(mx.concatenate([q, q], axis=2), k, v, mask)  # two queries
    assert not attention_cuda.supports(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), mask)
    assert not attention_cuda.supports(q[..., :96], k[..., :96], v[..., :96], mask)  # head size 96
    assert not attention_cuda.supports(q[:, :5], k, v, mask)  # 5 heads are not whole groups of 2
    assert not attention_cuda.supports(q, k, v, mask[:1])  # one mask row for two streams


def _replaying(calls: list[tuple]):
    """The kernel's place taken by its numpy replay (no CUDA here), recording its calls."""

    def attend(q, k, v, scale, mask):
        calls.append(q.shape)
        out = attention_cuda.replay(np.array(q.astype(mx.float32)), np.array(k.astype(mx.float32)),
                                    np.array(v.astype(mx.float32)), scale, np.array(mask))
        return mx.array(out).astype(q.dtype)

    return attend


def test_the_route_sends_only_what_it_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(attention_cuda, "attend", _replaying(calls))
    routed = attention_cuda.routed(mx.fast.scaled_dot_product_attention)
    assert routed.__wrapped__ is mx.fast.scaled_dot_product_attention
    q, k, v, mask = _inputs(2, 8, 2, 40, 64, [0, 5])
    q, k, v = (a.astype(mx.float16) for a in (q, k, v))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(routed(q, k, v, scale=0.125, mask=mask), want, atol=2e-3)
    assert calls == [(2, 8, 1, 64)]
    assert mx.array_equal(routed(q, k, v, scale=0.125, mask=None),
                          mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None))
    assert len(calls) == 1  # unmasked: MLX's


def test_a_routed_model_decodes_a_padded_batch_as_mlx_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's attention, routed (the kernel's replay in its place), gives a padded
    batch's decode step the logits MLX's own masked attention gives; the prompt's chunk
    stays MLX's; the route is made once. (A tiny llama in float16 with heads of 64: the
    demo model's heads of 32 in float32 are not the kernel's.)"""
    from mlx_lm.models import base
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(3)
    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    monkeypatch.setattr(base, "mx", base.mx)  # restored after the test
    prompts = [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 16, 17, 18]]
    padding = [0, 4]  # the second stream's prompt is its last three tokens

    def decode_logits():
        cache = [BatchKVCache(padding) for _ in model.layers]
        model(mx.array(prompts), cache=cache)
        return model(mx.array([[20], [21]]), cache=cache)[:, -1, :].astype(mx.float32)

    want = decode_logits()
    calls: list[tuple] = []
    monkeypatch.setattr(attention_cuda, "attend", _replaying(calls))
    mlxlm.route_attention(attention_cuda.routed)
    routed_fast = base.mx.fast
    mlxlm.route_attention(attention_cuda.routed)
    assert base.mx.fast is routed_fast  # once
    got = decode_logits()
    assert calls == [(2, 2, 1, 64)] * len(model.layers)  # each layer's one-query step, not the prompt
    assert mx.allclose(got, want, atol=2e-2).item()
    assert mx.fast.scaled_dot_product_attention is routed_fast.scaled_dot_product_attention.__wrapped__


def test_a_load_routes_only_on_cuda_and_when_asked(demo_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is built only on CUDA and used only with ``GMLX_ATTENTION_KERNEL=1``
    (not yet run on a GPU): on this CPU a load leaves mlx-lm's attention as MLX's,
    whatever the variable says."""
    from mlx_lm.models import base

    from gmlx.engine.kernels import prepare_layers

    monkeypatch.setattr(base, "mx", base.mx)
    monkeypatch.setenv("GMLX_ATTENTION_KERNEL", "1")
    assert not attention_cuda.available() and not attention_cuda.enabled()
    prepare_layers(demo_model.model)
    assert base.mx is mx
    monkeypatch.setattr(attention_cuda, "available", lambda: True)  # as on CUDA
    assert attention_cuda.enabled()
    monkeypatch.setenv("GMLX_ATTENTION_KERNEL", "0")
    assert not attention_cuda.enabled()
    monkeypatch.delenv("GMLX_ATTENTION_KERNEL")
    assert not attention_cuda.enabled()  # off unless asked for
