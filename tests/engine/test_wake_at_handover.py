"""``GMLX_WAKE_AT_HANDOVER=1``: a worker holds its streams' wake-ups until it hands its
next decode step over (or would wait). Every stream still gets every event, in order,
as without it: concurrent streams ending at different steps, a cancelled one, and a
request after the worker went idle (a held event left unwoken would hang it)."""

from __future__ import annotations

import asyncio

import pytest

from gmlx.engine import mailbox
from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker

GREEDY = SamplingParams(temperature=0.0)


def _requests(demo_model) -> list[GenerateRequest]:  # type: ignore[no-untyped-def]
    prompts = ["Hello", "Tell me a story", "Count to ten", "Why?"]
    return [GenerateRequest(tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": p}])),
                            max_tokens=n, sampling=GREEDY, id=f"r{n}")
            for p, n in zip(prompts, (5, 17, 30, 40), strict=True)]


async def _serve(worker: ModelWorker, requests: list[GenerateRequest]) -> list[tuple[list[int], str]]:
    """Each request's tokens and finish reason, read on this loop; the last one is
    cancelled after its third token; then one more request after the worker idled."""

    async def read(request: GenerateRequest, cancel_after: int | None) -> tuple[list[int], str]:
        handle = worker.submit(request)
        tokens: list[int] = []
        async for event in handle:
            tokens += event.token_ids or []
            if cancel_after is not None and len(tokens) >= cancel_after:
                handle.cancel()
                cancel_after = None
            if event.finish_reason is not None:
                return tokens, str(event.finish_reason)
        raise AssertionError("the stream ended without a final event")

    results = await asyncio.wait_for(asyncio.gather(
        *(read(r, 3 if i == len(requests) - 1 else None) for i, r in enumerate(requests))), timeout=60)
    await asyncio.sleep(0.2)  # the worker idles, blocked on its inbox
    results.append(await asyncio.wait_for(read(requests[0], None), timeout=30))
    return results


def _run(demo_model, monkeypatch: pytest.MonkeyPatch, hold: bool) -> list[tuple[list[int], str]]:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(mailbox.ENV, "1" if hold else "0")
    worker = ModelWorker(demo_model, decode_batch=4)
    try:
        results = asyncio.run(_serve(worker, _requests(demo_model)))
        # the decode step wakes the held streams as it hands over
        assert (worker._batch._gen._generation_batch.before_hand is mailbox.wake_held) is hold
        return results
    finally:
        worker.close()


def test_streams_held_for_the_handover_get_what_they_would_get_at_once(demo_model, monkeypatch):
    held = _run(demo_model, monkeypatch, hold=True)
    plain = _run(demo_model, monkeypatch, hold=False)
    finished = [(len(tokens), reason) for tokens, reason in held]
    assert finished[:3] == [(5, FinishReason.LENGTH), (17, FinishReason.LENGTH), (30, FinishReason.LENGTH)]
    assert finished[3][1] == FinishReason.CANCELLED and 3 <= finished[3][0] < 40
    assert finished[4] == (5, FinishReason.LENGTH)  # after the worker idled: no hang
    assert [t for t, _ in held[:3]] == [t for t, _ in plain[:3]] and held[4] == plain[4]  # the same tokens
