"""The memory model, against hand-computed cases and against MLX's measured peak."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from gmlx.engine import capacity as cap
from gmlx.engine.capacity import Geometry, LayerKV

G = Geometry(
    weight_bytes=1_000_000,
    layers=(LayerKV(512), LayerKV(512)),
    hidden_size=128,
    intermediate_size=256,
    vocab_size=718,
    n_heads=4,
    dtype_bytes=4,
    context_length=8192,
)


def test_kv_bytes_rounds_up_to_the_cache_step():
    assert cap.kv_bytes(G, 0) == 0
    assert cap.kv_bytes(G, 1) == 2 * 512 * 256
    assert cap.kv_bytes(G, 256) == 2 * 512 * 256
    assert cap.kv_bytes(G, 257) == 2 * 512 * 512
    assert G.kv_bytes_per_token == 1024


def test_sliding_window_and_fixed_state_layers():
    g = Geometry(**{**G.__dict__, "layers": (LayerKV(512), LayerKV(100, window=512), LayerKV(0, fixed_bytes=4096))})
    # full layer: 2048 tokens; windowed layer: capped at 512; recurrent: constant.
    assert cap.kv_bytes(g, 2000) == 512 * 2048 + 100 * 512 + 4096
    assert g.kv_bytes_per_token == 512


def test_prefill_transient_by_hand():
    scores = 4 * 512 * 1024 * 4 * 11 // 10  # heads x chunk x context x bytes, +10%
    activations = 512 * (2 * 256 + 4 * 128) * 4 * 5 // 2
    logits = 718 * 4 * 2
    assert cap.prefill_transient(G, 512, 1024) == scores + activations + logits
    fused = Geometry(**{**G.__dict__, "fused_attention": True})
    assert cap.prefill_transient(fused, 512, 1024) == activations + logits
    # A chunk never exceeds the context it ends at.
    assert cap.prefill_transient(G, 512, 100) == cap.prefill_transient(G, 100, 100)


def test_worst_chunk_and_warm_tokens():
    # 1100 cold tokens in chunks of 512: full chunks end at 512 and 1024, the last
    # (76 tokens) ends at 1100; the worst is the full chunk ending at 1024.
    assert cap.worst_prefill_transient(G, 1100, 512) == cap.prefill_transient(G, 512, 1024)
    # 1000 warm tokens leave a 100-token chunk ending at 1100.
    assert cap.worst_prefill_transient(G, 1100, 512, warm_tokens=1000) == cap.prefill_transient(G, 100, 1100)


def test_request_need_counts_pinned_output():
    need = cap.request_need(G, 1000, max_tokens=24, chunk=512)
    assert need.kv_bytes == cap.kv_bytes(G, 1024)
    assert need.need_bytes == need.kv_bytes + need.transient_bytes
    assert cap.request_need(G, 1000, max_tokens=None, chunk=512).kv_bytes == cap.kv_bytes(G, 1000)


def test_max_width_and_max_context_by_hand():
    budget = 10 * cap.kv_bytes(G, 1024) + cap.prefill_transient(G, 512, 1024)
    assert cap.max_width(G, 1024, budget, 512) == 10
    assert cap.max_width(G, 1024, budget - 1, 512) == 9
    assert cap.max_width(G, 9000, budget, 512) == 0  # beyond the context window
    small = Geometry(**{**G.__dict__, "context_length": 3000})
    for width, budget in [(1, 4_000_000), (4, 6_000_000), (8, 2_500_000)]:
        brute = max((d for d in range(3001) if cap.fits(small, width, d, budget, 512)), default=0)
        assert cap.max_context(small, width, budget, 512) == brute
    assert cap.max_context(G, 1, 10**15, 512) == G.context_length  # capped by the window


def test_capacity_table_is_read_conservatively():
    budget = 64 * 1024**2
    table = cap.capacity_table(G, budget, 512)
    ctx = [table.max_ctx[w] for w in cap.WIDTHS]
    assert ctx == sorted(ctx, reverse=True)  # wider fan-outs get less context each
    assert table.max_ctx_at(3) == table.max_ctx[4]
    assert table.max_ctx_at(1000) is None
    ok, reason = cap.plan(table, 3, table.max_ctx[4])
    assert ok and reason is None
    ok, reason = cap.plan(table, 3, table.max_ctx[4] + 1)
    assert not ok and "exceeds max context" in reason
    assert cap.default_decode_batch(table, context=4096) >= 1
    d = table.as_dict()
    assert d["max_ctx"]["1"] == table.max_ctx[1] and d["kv_bytes_per_token"] == 1024


def test_a_drafter_adds_its_weights_and_its_kv_per_token():
    draft = Geometry(**{**G.__dict__, "weight_bytes": 200_000, "layers": (LayerKV(256),)})
    both = cap.with_drafter(G, draft)
    assert both.weight_bytes == 1_200_000 and both.kv_bytes_per_token == 1024 + 256
    assert cap.kv_bytes(both, 1000) == cap.kv_bytes(G, 1000) + cap.kv_bytes(draft, 1000)
    assert cap.prefill_transient(both, 512, 4096) == cap.prefill_transient(G, 512, 4096)
    budget = 64 * 1024**2
    alone, drafted = cap.capacity_table(G, budget, 512), cap.capacity_table(both, budget, 512)
    assert all(drafted.max_ctx[w] <= alone.max_ctx[w] for w in cap.WIDTHS)
    assert drafted.max_ctx[32] < alone.max_ctx[32]


def test_probe_reads_the_demo_models_cache_layout(demo_model):
    g = cap.probe_geometry(demo_model)
    cfg = demo_model.config
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_layer = 2 * cfg["num_key_value_heads"] * head_dim * 4  # K and V, float32
    assert g.layers == tuple(LayerKV(per_layer) for _ in range(cfg["num_hidden_layers"]))
    assert g.context_length == demo_model.context_length and g.vocab_size == cfg["vocab_size"]


@pytest.fixture(scope="module", params=["float16", "float32"])
def wider_model(request, demo_model, tmp_path_factory):
    """A random model wide enough that activations and KV, not weights, dominate."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from gmlx.engine.loading import load_model

    folder = tmp_path_factory.mktemp("wide") / "model"
    shutil.copytree(demo_model.source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(hidden_size=256, num_hidden_layers=4, intermediate_size=704, num_attention_heads=8,
               num_key_value_heads=2)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(getattr(mx, request.param))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg))
    return load_model(folder)


@pytest.mark.parametrize("prompt_tokens", [200, 1000, 2048])
def test_estimate_is_within_15_percent_of_measured_peak(wider_model, prompt_tokens):
    """weights + need_bytes predicts mx.get_peak_memory() of a real prefill."""
    from gmlx.engine.types import GenerateRequest, SamplingParams
    from gmlx.engine.worker import ModelWorker

    geom = cap.probe_geometry(wider_model)
    worker = ModelWorker(wider_model, decode_batch=1, prompt_cache_bytes=0)
    try:
        prompt = tuple((i * 7) % 700 + 3 for i in range(prompt_tokens))
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        list(worker.generate(GenerateRequest(prompt, max_tokens=1, sampling=SamplingParams(temperature=0))))
        peak = mx.get_peak_memory()
    finally:
        worker.close()
    need = cap.request_need(geom, prompt_tokens, max_tokens=1, chunk=worker.prefill_step_size)
    assert base >= geom.weight_bytes
    ratio = (base + need.need_bytes) / peak
    assert 0.85 <= ratio <= 1.15, f"predicted/measured peak = {ratio:.3f}"
