"""The decode step's phases (GMLX_STEP_TIMES): the recorder's arithmetic, and a worker's
real steps stamped and summarised."""

from __future__ import annotations

import gc
import logging

import pytest

from gmlx.engine import step_times
from gmlx.engine.step_times import StepTimes
from gmlx.engine.types import GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker


def _steps(times: StepTimes, width: int, count: int, start: float = 0.0) -> float:
    """``count`` steps of 10 ms each: build 1, hand 2, wait 4, read 1, then 2 between."""
    t = start
    for _ in range(count):
        times.note(width, t, t + 0.001, t + 0.003, t + 0.007, t + 0.008)
        t += 0.010
    return t


def test_phases_are_the_medians_of_the_steps_and_the_period_spans_them():
    times = StepTimes(every=4)
    _steps(times, 1, 5)  # the first step has no step before it: four periods, then a summary
    assert len(times.summaries) == 1
    line = times.summaries[0]
    assert "decode steps of 1 row(s), the last 4: 10.000 ms a step (p90 10.000, mean 10.000, longest 10.000)" in line
    assert "build 1.000, hand 2.000, wait 4.000, read 1.000, between 2.000" in line


def test_a_stall_shows_in_the_mean_and_the_longest_and_collections_are_counted():
    times = StepTimes(every=10)
    try:
        gc.collect()  # before any step: not counted
        t = _steps(times, 1, 6)
        times.note(1, t + 0.090, t + 0.091, t + 0.093, t + 0.097, t + 0.098)  # 100 ms since the last step ended
        gc.collect()  # a full pass
        _steps(times, 1, 4, start=t + 0.100)
    finally:
        times.close()
    line = times.summaries[0]
    assert "10.000 ms a step" in line and "mean 19.000" in line and "longest 100.000" in line
    assert "1 of generation 2 (" in line  # the one between steps, not the one before them
    assert times._on_collection not in gc.callbacks


def test_a_new_width_or_a_pause_starts_afresh():
    times = StepTimes(every=100)
    t = _steps(times, 1, 3)
    t = _steps(times, 2, 3, start=t + 5.0)  # the width changed: width 1's two periods summarised
    assert [s.split(",")[0] for s in times.summaries] == ["decode steps of 1 row(s)"]
    assert "the last 2:" in times.summaries[0]
    times.pause()  # idle for a second: no step spans it
    _steps(times, 2, 2, start=t + 1.0)
    times._flush()
    assert "the last 3: 10.000 ms a step" in times.summaries[-1]


@pytest.mark.parametrize(("value", "expected"), [("", None), ("0", None), ("abc", None), ("64", 64)])
def test_the_setting(monkeypatch, value, expected):
    monkeypatch.setenv(step_times.ENV, value)
    times = step_times.from_env()
    assert (times and times.every) == expected


def test_a_workers_decode_steps_are_stamped(monkeypatch, demo_model, caplog):
    monkeypatch.setenv(step_times.ENV, "8")
    worker = ModelWorker(demo_model, decode_batch=2)
    try:
        with caplog.at_level(logging.INFO, logger=step_times.__name__):
            prompt = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "Hello"}]))
            events = list(worker.generate(GenerateRequest(prompt, max_tokens=20,
                                                          sampling=SamplingParams(temperature=0.0))))
        times = worker._batch.step_times
        passes = [n for n, _ in times._collections]
        gc.collect()  # the request ended, the worker idle: a load's or an idle collection is no step's
        idle_passes = [n for n, _ in times._collections]
    finally:
        worker.close()
    assert events[-1].usage.completion_tokens == 20
    lines = [r.getMessage().split("; collector passes")[0] for r in caplog.records if r.name == step_times.__name__]
    # 20 tokens: the first from the prompt's step, then decode steps, eight a summary
    assert lines and all(line.startswith("decode steps of 1 row(s), the last 8:") for line in lines)
    assert idle_passes == passes
    for line in lines:
        phases = dict(part.split() for part in line.split("medians in ms: ")[1].split(", "))
        assert set(phases) == set(step_times.PHASES)
        assert all(float(ms) >= 0 for ms in phases.values())
