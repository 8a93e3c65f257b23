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


def test_a_holding_thread_wakes_the_loop_only_when_it_says():
    """A worker thread that holds its wake-ups (``GMLX_WAKE_AT_HANDOVER``) posts without
    waking the loop; ``wake_held`` wakes it once for all it posted, in order; a thread
    that does not hold wakes the loop as it posts, and delivers the held events too."""
    from gmlx.engine import mailbox

    async def main() -> tuple[list[str], list[int], list[str]]:
        loop = asyncio.get_running_loop()
        wakeups: list[int] = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            wakeups.append(1)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        held, other = (RequestHandle(_request(i), cancel=lambda _id: None) for i in range(2))
        seen: list[int] = []

        def holding(step: str) -> None:
            mailbox.hold()  # (the thread's own: it ends with the thread)
            for n in range(3):
                held._emit(Event(held.id, text=f"{step}{n}"))
            seen.append(len(wakeups))  # posted, not woken
            if step == "a":
                mailbox.wake_held()
                seen.append(len(wakeups))
                mailbox.release()

        def run(target, *args) -> None:  # type: ignore[no-untyped-def]
            thread = threading.Thread(target=target, args=args)
            thread.start()
            thread.join()

        run(holding, "a")
        await asyncio.sleep(0.01)
        run(holding, "b")  # held, never woken by its own thread
        await asyncio.sleep(0.01)
        got = [held._ready.popleft().text for _ in range(len(held._ready))]
        run(lambda: other._emit(Event(other.id, text="x")))  # a thread that does not hold
        await asyncio.sleep(0.01)
        late = [held._ready.popleft().text for _ in range(len(held._ready))]
        return got, seen, late

    got, seen, late = asyncio.run(main())
    assert seen == [0, 1, 1]  # three posts, then one wake-up; the second thread's three none
    assert got == ["a0", "a1", "a2"]  # the held thread's second round still waits
    assert late == ["b0", "b1", "b2"]  # delivered with the other thread's wake-up, in order
