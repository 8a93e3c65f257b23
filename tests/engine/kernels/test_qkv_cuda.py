"""An attention's queries, keys and values in one product (``qkv_cuda``): which layers
take it, and the wiring and tuning through real models with MLX's own products standing
in for the kernel (the same logits, bit for bit). The kernel's own source is run on the
CPU against MLX's products in ``test_qgemv_cuda.py`` (its parts mode)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from gmlx.engine.kernels import cuda_source, one_token, qkv_cuda, step_tuning
from tests.engine.kernels.models import step_clock, steps, tiny

LAYERS = 2
FAMILIES = ("llama", "qwen3", "gemma3_text")  # q/k/v without biases (qwen2's have them)


def _model(family: str, *, values_bits: int = 4) -> nn.Module:
    model = tiny(family, LAYERS, dtype=mx.bfloat16, seed=13)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and not p.endswith("v_proj"))
    nn.quantize(model, group_size=32, bits=values_bits, class_predicate=lambda p, m: p.endswith("v_proj"))
    one_token.attach(model, rotation=lambda attention: None)
    return model


def _recording(calls: list):
    def make(attention):
        def project(attention, x, rows):
            calls.append((tuple(x.shape), rows))
            return qkv_cuda.mlx_project(attention)(attention, x, rows)

        return project

    return make


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("streams", [1, 3, 9])
def test_the_wiring_gives_the_same_logits(family: str, streams: int) -> None:
    """With MLX's products in the kernel's place the model computes what it computed; the
    one product takes one-token steps of up to eight streams, never a prompt, nor a step
    of more streams."""
    model = _model(family)
    prompts = mx.array([[3, 1, 4, 1, 5, 9][i % 3:] + [2] * (i % 3) for i in range(streams)])

    def caches() -> list:
        return [BatchKVCache([0] * streams) for _ in range(LAYERS)] if streams > 1 else make_prompt_cache(model)

    want = steps(model, caches(), prompts)
    calls: list = []
    assert qkv_cuda.attach(model, _recording(calls)) == LAYERS
    got = steps(model, caches(), prompts)
    for a, b in zip(want, got, strict=True):
        assert mx.array_equal(a, b).item()
    assert calls == ([((streams, 1, 128), streams)] * LAYERS * 4 if streams <= step_tuning.MAX_ROWS else [])
    qkv_cuda.detach(model)
    assert not qkv_cuda.projected(model)


def test_which_projections_one_product_reads() -> None:
    """All three when quantized alike; queries and keys when the values' layout differs;
    none for float layers or projections with biases (qwen2)."""
    assert qkv_cuda.joined(_model("llama").layers[0].self_attn) == ("q_proj", "k_proj", "v_proj")
    assert qkv_cuda.joined(_model("llama", values_bits=8).layers[0].self_attn) == ("q_proj", "k_proj")
    assert qkv_cuda.joined(tiny("llama", LAYERS, dtype=mx.bfloat16).layers[0].self_attn) == ()
    assert qkv_cuda.joined(tiny("qwen2", LAYERS, quantized=True, dtype=mx.bfloat16).layers[0].self_attn) == ()


def test_the_values_of_another_layout_come_through_their_own_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries and keys from one bound product per bucket (their layers' weights, in
    order: the CUDA-core source at 1 and 2 streams, the tensor-core one past them), the
    values from their own layer. (The kernels' ``bound`` stand in: CUDA cannot run here.)"""
    attention = _model("llama", values_bits=8).layers[0].self_attn
    bound: list = []

    def binder(name: str):
        def fake_bound(w, scales, biases, group_size, bits, config, more, heads=(), stacked=None):
            bound.append((name, config))
            assert w is attention.q_proj.weight and [m[0] for m in more] == [attention.k_proj.weight]
            assert heads == qkv_cuda.heads(attention)[:2]
            return lambda x: tuple(mx.full(shape, value, x.dtype) for shape, value in zip(
                cuda_source.out_shapes(x.shape[:-1], (w.shape[0], more[0][0].shape[0]), heads), (0, 1), strict=True))
        return fake_bound

    monkeypatch.setattr(qkv_cuda.qgemv_cuda, "bound", binder("gemv"))
    monkeypatch.setattr(qkv_cuda.qmmw_cuda, "bound", binder("tensor cores"))
    project = qkv_cuda.kernel(attention)
    x = mx.random.normal((20, 1, 128)).astype(mx.bfloat16)
    q, k, v = project(attention, x[:2], 2)
    heads, kv_heads, _ = qkv_cuda.heads(attention)
    # one token a stream, per head, as the attention reads them; the values as their layer writes them
    assert mx.array_equal(v, attention.v_proj(x[:2])).item()
    assert (q.shape, k.shape) == ((2, heads, 1, 128 // heads), (2, kv_heads, 1, 64 // kv_heads))
    project(attention, x[:2], 2)
    project(attention, x[:1], 1)
    q, k, v = project(attention, x, 20)
    assert mx.array_equal(v, attention.v_proj(x)).item()
    assert (q.shape, k.shape) == ((20, heads, 1, 128 // heads), (20, kv_heads, 1, 64 // kv_heads))
    project(attention, x[:5], 5)
    assert bound == [("gemv", qkv_cuda.qgemv_cuda.configs(2)[0]), ("gemv", qkv_cuda.qgemv_cuda.configs(1)[0]),
                     ("tensor cores", qkv_cuda.qmmw_cuda.configs(20)[0]),
                     ("tensor cores", qkv_cuda.qmmw_cuda.configs(5)[0])]


def _timed(monkeypatch: pytest.MonkeyPatch, faster: dict[int, float]) -> list:
    """Whole steps timed 1.0 s, ``faster[rows]`` with the one product taken."""
    return step_clock(monkeypatch, lambda model, rows: any(step_tuning.bucket(rows) in a._project_buckets
                                                           for a in qkv_cuda.projected(model)), faster)


def test_tuning_keeps_the_faster_buckets_and_remembers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(qkv_cuda.ENV, raising=False)
    model = _model("qwen3")
    qkv_cuda.attach(model, qkv_cuda.mlx_project, buckets=())
    timed = _timed(monkeypatch, {2: 0.9, 8: 0.99})
    note = qkv_cuda.tune(model)
    assert len(timed) == 4 * len(step_tuning.BUCKETS) and "2: 1.11x" in note
    assert all(a._project_buckets == {2} for a in qkv_cuda.projected(model))
    again = _model("qwen3")
    qkv_cuda.attach(again, qkv_cuda.mlx_project, buckets=())
    timed = _timed(monkeypatch, {})
    assert qkv_cuda.tune(again) == note and timed == []


def test_a_product_that_disagrees_is_never_taken(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(qkv_cuda.ENV, raising=False)
    model = _model("llama")

    def wrong(attention):
        return lambda attention, x, rows: tuple(a * 1.1 for a in qkv_cuda.mlx_project(attention)(attention, x, rows))

    qkv_cuda.attach(model, wrong, buckets=())
    timed = _timed(monkeypatch, {1: 0.5})
    assert "none faster" in qkv_cuda.tune(model) and timed == []
    assert qkv_cuda.projected(model) == []  # taken nowhere: three products again


def test_set_to_1_it_takes_every_bucket_untimed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.setenv(qkv_cuda.ENV, "1")
    model = _model("gemma3_text")
    qkv_cuda.attach(model, qkv_cuda.mlx_project, buckets=())
    timed = _timed(monkeypatch, {})
    assert "every step of 1-64 streams" in qkv_cuda.tune(model) and timed == []
    assert all(a._project_buckets == set(step_tuning.BUCKETS) for a in qkv_cuda.projected(model))


def test_one_token_a_stream_is_written_per_head_so_no_reshape_follows(tmp_path) -> None:
    """The products write one token a stream as ``(B, heads, 1, D)``: the same elements in
    the same order as ``(B, 1, heads * D)``, so the attention's reshapes are the same shape
    and MLX puts no reshape into the step's graph (a primitive the host hands over every
    step); prompts, and rows without a token axis, stay as written."""
    assert cuda_source.out_shapes((2, 1), (128, 64, 64), (4, 2, 2)) == [(2, 4, 1, 32), (2, 2, 1, 32), (2, 2, 1, 32)]
    assert cuda_source.out_shapes((2, 3), (128,), (4,)) == [(2, 3, 128)]  # a prompt's rows
    assert cuda_source.out_shapes((2,), (128,), (4,)) == [(2, 128)]
    assert cuda_source.out_shapes((2, 1), (128,)) == [(2, 1, 128)]
    attention = _model("llama").layers[0].self_attn
    object.__setattr__(attention, "_fold", ("inv", "pairs"))  # the in-place attention rotates them
    x = mx.random.normal((2, 1, 128)).astype(mx.bfloat16)
    flat = qkv_cuda.mlx_project(attention)(attention, x, 2)
    mx.eval(flat)
    per_head = [p.reshape(s) for p, s in zip(flat, cuda_source.out_shapes((2, 1), [p.shape[-1] for p in flat],
                                                                       qkv_cuda.heads(attention)), strict=True)]
    mx.eval(per_head)

    def reshapes(arrays) -> int:
        mx.export_to_dot(str(tmp_path / "graph.dot"), *arrays)
        return (tmp_path / "graph.dot").read_text().count('label ="Reshape"')

    offset = mx.array([3, 3], mx.int32)
    assert reshapes(one_token.shaped(attention, *flat, offset)) == 3
    shaped = one_token.shaped(attention, *per_head, offset)
    assert reshapes(shaped) == 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(shaped, one_token.shaped(attention, *flat, offset),
                                                             strict=True))
