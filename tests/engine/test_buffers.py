"""MLX's buffer cache across prefill chunks: a model worker keeps up to its allowance."""

from __future__ import annotations

import importlib
import threading

import mlx.core as mx

from gmlx.engine import buffers, capacity
from gmlx.engine.residency import ModelSpec, Registry
from gmlx.engine.types import GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker, default_prefill_step

MIB = 1024**2


def _cached_after_free(n_bytes: int) -> None:
    """Leave about ``n_bytes`` in MLX's buffer cache."""
    mx.clear_cache()
    a = mx.zeros((n_bytes // 4,), dtype=mx.float32)
    mx.eval(a)
    del a
    assert mx.get_cache_memory() >= n_bytes


def _on_thread(fn) -> object:
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join(30)
    return box[0]


def _mlx_lm_clears() -> None:
    """What mlx-lm's batch generator calls after every prefill chunk."""
    importlib.import_module("mlx_lm.generate").mx.clear_cache()


def test_mlx_lm_clears_keep_what_the_thread_allows_and_no_more():
    def worker_thread() -> tuple[int, int]:
        buffers.keep_buffers(8 * MIB)
        _cached_after_free(4 * MIB)
        _mlx_lm_clears()  # within the allowance: kept
        kept = mx.get_cache_memory()
        _cached_after_free(16 * MIB)  # (MLX caches at most 32 MiB here by default)
        _mlx_lm_clears()  # past it: emptied
        return kept, mx.get_cache_memory()

    kept, over = _on_thread(worker_thread)
    assert kept >= 4 * MIB
    assert over == 0

    def other_thread() -> int:  # no allowance: mlx-lm's clear empties the cache as before
        _cached_after_free(4 * MIB)
        _mlx_lm_clears()
        return mx.get_cache_memory()

    assert _on_thread(other_thread) == 0
    # The view is mlx.core in everything else.
    generate_mx = importlib.import_module("mlx_lm.generate").mx
    assert generate_mx.clear_cache is not mx.clear_cache
    assert generate_mx.array is mx.array and generate_mx.eval is mx.eval


def _clears_during_a_chunked_prompt(demo_model, monkeypatch, allowance: int | None) -> tuple[int, list[int]]:
    calls = []
    real = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: (calls.append(1), real())[1])
    worker = ModelWorker(demo_model, decode_batch=2, prefill_step_size=64, buffer_cache_bytes=allowance)
    try:
        prompt = tuple((7 * i + 3) % 500 + 10 for i in range(300))  # five 64-token chunks
        events = list(worker.generate(GenerateRequest(prompt, max_tokens=6, sampling=SamplingParams(temperature=0))))
    finally:
        worker.close()
    return len(calls), [t for e in events for t in e.token_ids]


def test_a_worker_keeps_buffers_across_prefill_chunks_and_answers_the_same(demo_model, monkeypatch):
    kept_clears, kept_tokens = _clears_during_a_chunked_prompt(demo_model, monkeypatch, 1024 * MIB)
    default_clears, default_tokens = _clears_during_a_chunked_prompt(demo_model, monkeypatch, None)
    assert kept_clears == 0
    assert default_clears >= 5  # mlx-lm empties the cache after every chunk
    assert kept_tokens == default_tokens and len(kept_tokens) == 6


def test_the_registry_allows_one_prefill_chunk_transient(gmlx_home):
    registry = Registry([ModelSpec("demo", "demo")], governor=False)
    try:
        worker = registry.worker("demo")
        geom = registry.geometry("demo")
        assert geom is not None
        expected = capacity.prefill_transient(geom, default_prefill_step(), worker.loaded.context_length)
        assert worker.buffer_cache_bytes == expected > 0
    finally:
        registry.close()


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # freed only by the cyclic collector


def test_a_load_freezes_what_it_left_and_an_unload_collects_frozen_cycles(gmlx_home):
    import gc
    import weakref

    from gmlx.engine import residents

    gc.unfreeze()
    registry = Registry([ModelSpec("demo", "demo")], governor=False)
    try:
        registry.worker("demo")
        # the load's objects are out of the full passes (a full pass walked ~170,000)
        assert gc.get_freeze_count() > 10_000
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        residents.settle()  # frozen with the rest, then unreachable
        del cycle
        gc.collect()
        assert alive() is not None  # a full pass does not see frozen objects
        assert registry.unload("demo")  # an unload's collection does
        assert alive() is None
        assert gc.get_freeze_count() > 0  # and what survived it is frozen again
    finally:
        registry.close()
        gc.unfreeze()
