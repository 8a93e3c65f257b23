"""Request isolation: a request whose own code fails ends alone, and a worker whose
loop fails restarts; the other streams produce exactly what they would have alone."""

from __future__ import annotations

import logging
import threading

import pytest

from gmlx.engine.errors import EngineError
from gmlx.engine.requests import ActiveRequest
from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["Hello there", "What is two plus two?", "Name a colour.", "Tell me a story.",
             "Why is the sky blue?", "Count to five.", "Say something kind.", "Who are you?"]
FAIL_AT = 3  # the step at which the broken request's own code raises


def prompt(demo_model, text: str) -> tuple[int, ...]:
    return tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": text}]))


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def raising_at(step: int, fn, what: str):
    """``fn``, except that its ``step``-th call (from 1) and every later one raise."""
    calls = 0

    def broken(*args):
        nonlocal calls
        calls += 1
        if calls >= step:
            raise ValueError(f"{what} broke at call {calls}")
        return fn(*args)

    return broken


def break_requests(monkeypatch, where: str) -> None:
    """Requests whose id starts with ``bad-`` get a logits processor (``processor``) or
    a text pipeline (``pipeline``: the detokenizer and the steps after it) that raises
    at step ``FAIL_AT``."""
    real = ActiveRequest.prepare.__func__

    def prepare(cls, handle, tokenizer, **kwargs):
        active = real(cls, handle, tokenizer, **kwargs)
        if handle.id.startswith("bad-"):
            if where == "processor":
                active.processors.append(raising_at(FAIL_AT, lambda tokens, logits: logits, "processor"))
            else:
                active.pipeline.feed = raising_at(FAIL_AT, active.pipeline.feed, "detokenizer")
        return active

    monkeypatch.setattr(ActiveRequest, "prepare", classmethod(prepare))


@pytest.mark.parametrize("width", [1, 8])
@pytest.mark.parametrize("where", ["processor", "pipeline"])
def test_a_failing_request_ends_alone_and_the_batch_goes_on(demo_model, monkeypatch, caplog, width, where):
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=width)
    try:
        good = [GenerateRequest(prompt(demo_model, q), max_tokens=16, sampling=GREEDY, id=f"good-{i}")
                for i, q in enumerate(QUESTIONS[: max(width - 1, 1)])]
        alone = [tokens(worker.generate(r)) for r in good]  # before any request is broken
        break_requests(monkeypatch, where)
        bad = worker.submit(GenerateRequest(prompt(demo_model, "Break here."), max_tokens=16,
                                            sampling=GREEDY, id="bad-1"))
        handles = [worker.submit(r) for r in good]
        with caplog.at_level(logging.ERROR, logger="gmlx.engine"):
            with pytest.raises(EngineError) as info:
                list(bad)
            together = [list(h) for h in handles]
        assert "bad-1" in str(info.value) and "broke at call" in str(info.value)
        assert info.value.code == "engine_error"
        assert any("bad-1" in r.getMessage() for r in caplog.records)
        for events, expected in zip(together, alone, strict=True):
            assert events[-1].finish_reason is FinishReason.LENGTH
            assert tokens(events) == expected
        assert worker.in_flight == 0 and worker.rows() == []
    finally:
        worker.close()


def test_a_worker_whose_loop_fails_restarts_and_serves_again(demo_model, monkeypatch, caplog):
    """A fault in the worker's loop, outside any one request, ends the requests in
    flight with an ``engine_error`` naming them; the worker restarts and serves the
    next request as before, without the model being loaded again."""
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=4)
    try:
        request = GenerateRequest(prompt(demo_model, QUESTIONS[1]), max_tokens=40, sampling=GREEDY)
        before = tokens(worker.generate(request))
        decoding = threading.Event()
        real_govern = worker._govern

        def govern():  # once two requests decode, the loop fails once
            if not decoding.is_set() and sum(a.generated > 0 for a in worker._batch.running.values()) == 2:
                decoding.set()
                raise RuntimeError("injected worker fault")
            return real_govern()

        monkeypatch.setattr(worker, "_govern", govern)
        handles = [worker.submit(GenerateRequest(prompt(demo_model, q), max_tokens=40, sampling=GREEDY,
                                                 id=f"inflight-{i}")) for i, q in enumerate(QUESTIONS[:2])]
        with caplog.at_level(logging.ERROR, logger="gmlx.engine"):
            for i, handle in enumerate(handles):
                with pytest.raises(EngineError, match=f"inflight-{i}.*injected worker fault"):
                    list(handle)
        assert decoding.is_set() and worker.restarts == 1 and worker.alive
        assert any("injected worker fault" in r.getMessage() for r in caplog.records)
        assert tokens(worker.generate(request)) == before
        assert worker.in_flight == 0 and worker.rows() == []
    finally:
        worker.close()


def test_abort_ends_everything_with_the_error_and_serves_on(demo_model, monkeypatch):
    from gmlx.engine.errors import ServerOverloadedError
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=1)
    try:
        aborted = threading.Event()
        real_govern = worker._govern

        def govern():  # the worker's first step waits until everything is sent
            aborted.wait(30)
            return real_govern()

        monkeypatch.setattr(worker, "_govern", govern)
        handles = [worker.submit(GenerateRequest(prompt(demo_model, q), max_tokens=200, sampling=GREEDY))
                   for q in QUESTIONS[:3]]  # one running, two queued
        worker.abort(ServerOverloadedError("shutting down"))
        aborted.set()
        for handle in handles:
            with pytest.raises(ServerOverloadedError, match="shutting down"):
                list(handle)
        request = GenerateRequest(prompt(demo_model, QUESTIONS[0]), max_tokens=4, sampling=GREEDY)
        assert list(worker.generate(request))[-1].finish_reason is FinishReason.LENGTH
        assert worker.waiting_for_slot == 0 and worker.rows() == []
    finally:
        worker.close()
