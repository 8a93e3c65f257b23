"""The metrics snapshot and its Prometheus rendering."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gmlx.engine import metrics
from gmlx.engine.errors import ServerOverloadedError
from gmlx.engine.types import GenerateRequest, SamplingParams


def test_snapshot_sections_with_a_live_request(demo_worker, demo_model):
    tokens = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "metrics"}]))
    handle = demo_worker.submit(GenerateRequest(tokens, max_tokens=300, sampling=SamplingParams(temperature=0)))
    events = iter(handle)
    for _ in range(3):
        next(events)
    snap = metrics.snapshot([demo_worker], started_at=time.monotonic() - 5)
    assert set(snap) == {"server"}  # one layout: every section under server
    live = snap["server"]
    try:
        assert live["concurrency"]["in_flight"] == 1
        assert live["concurrency"]["decode_batch"] == demo_worker.decode_batch
        assert live["queue"]["waiting"] == 0 and live["queue"]["eta_s"] == 0
        (row,) = live["requests"]
        assert row["id"] == handle.id and row["state"] == "decode"
        assert set(row) >= {"id", "model", "state", "position", "prompt_tokens", "generated", "max_tokens",
                            "elapsed_s", "ttft_s", "decode_tok_s", "cache", "speculative"}
        (model,) = live["resident_models"]
        assert model["id"] == "demo" and model["in_flight"] == 1 and model["weight_bytes"] > 0
        assert live["memory"]["headroom_bytes"] > 0
        assert set(live["rates"]) == set(metrics.EMPTY_SECTIONS["rates"])
        assert live["uptime_s"] >= 5
    finally:
        handle.cancel()
        list(events)


def test_a_failing_section_is_null_not_fatal(demo_worker, monkeypatch):
    def broken():
        raise RuntimeError("probe failed")

    monkeypatch.setattr(metrics, "memory", broken)
    live = metrics.snapshot([demo_worker], started_at=time.monotonic())["server"]
    assert live["memory"] == dict.fromkeys(metrics.EMPTY_SECTIONS["memory"])
    assert live["concurrency"]["decode_batch"] == demo_worker.decode_batch
    assert live["rates"]["decode_streams"] is not None  # the other sections still answer


def test_prometheus_text_parses_and_names_the_gauges(demo_worker):
    snap = metrics.snapshot(
        [demo_worker],
        started_at=time.monotonic(),
        model_extra=lambda w: {"profile": "coding"},
        governor=lambda: {"enabled": True, "band": "yellow", "sheds": 2, "admission_paused": False},
        capacity=lambda: {"max_ctx": {1: 8192, 2: 4096}},
    )
    text = metrics.render_prometheus(snap).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("gmlx_concurrency_in_flight", "gmlx_queue_eta_s", "gmlx_governor_band",
                 "gmlx_capacity_max_ctx", "gmlx_model_in_flight", "gmlx_requests"):
        assert name in families, name
    bands = {s.labels["band"]: s.value for s in families["gmlx_governor_band"].samples}
    assert bands == {"green": 0.0, "yellow": 1.0, "orange": 0.0, "red": 0.0}
    widths = {s.labels["width"]: s.value for s in families["gmlx_capacity_max_ctx"].samples}
    assert widths == {"1": 8192.0, "2": 4096.0}
    (sample,) = families["gmlx_model_in_flight"].samples
    assert sample.labels == {"model": "demo", "profile": "coding"}


def test_counters_count_outcomes(demo_model):
    """`counters`: requests finished by outcome since the model loaded (completed to the
    end or the cap, cancelled), and the queue's refusals."""
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=1, queue_cap=0)
    try:
        tokens = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "count"}]))
        greedy = SamplingParams(temperature=0)
        list(worker.generate(GenerateRequest(tokens, max_tokens=3, sampling=greedy)))
        long = worker.submit(GenerateRequest(tokens, max_tokens=500, sampling=greedy))
        events = iter(long)
        next(events)
        with pytest.raises(ServerOverloadedError):  # the queue cap is 0, the one slot taken
            worker.submit(GenerateRequest(tokens, max_tokens=3, sampling=greedy))
        long.cancel()
        list(events)
        counted = metrics.snapshot([worker], started_at=time.monotonic())["server"]["counters"]
        assert counted == {"finished": 2, "completed": 1, "cancelled": 1, "shed": 0,
                           "errors": 0, "refused": 1}
    finally:
        worker.close()
