"""Request handles on an event loop: a decode step's events reach the loop in one
hand-over, in order per stream."""

from __future__ import annotations

import asyncio
import threading

from gmlx.engine.requests import RequestHandle
from gmlx.engine.types import Event, FinishReason, GenerateRequest


def _request(i: int) -> GenerateRequest:
    return GenerateRequest((1, 2, 3), max_tokens=4, id=f"req-{i}")


def test_a_steps_events_wake_the_loop_once_and_keep_their_order():
    async def main() -> tuple[list[list[str]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        handles = [RequestHandle(_request(i), cancel=lambda _id: None) for i in range(4)]

        def worker() -> None:  # three steps of four streams
            for step in range(3):
                for h in handles:
                    final = step == 2
                    h._emit(Event(h.id, text=f"{h.id}:{step}",
                                  finish_reason=FinishReason.LENGTH if final else None))

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()  # on the loop's thread: the loop cannot run until every event is posted

        async def read(h: RequestHandle) -> list[str]:
            return [ev.text async for ev in h]

        texts = await asyncio.gather(*(read(h) for h in handles))
        return texts, wakeups

    texts, wakeups = asyncio.run(main())
    assert texts == [[f"req-{i}:{s}" for s in range(3)] for i in range(4)]
    assert wakeups == 1  # twelve events posted while the loop was busy: one hand-over

