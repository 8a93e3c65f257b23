"""The memory governor: bands, hysteresis, admission and shedding."""

from __future__ import annotations

from gmlx.engine.governor import Band, Governor, ShedError, default_floor
from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker

MiB = 1024**2


class Headroom:
    """A scripted memory probe."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def governor(probe, **kw) -> Governor:
    return Governor(probe, floor_bytes=100 * MiB, interval_s=0.0, shed_cooldown_s=0.0, **kw)


def test_bands_follow_headroom_down_at_once():
    probe = Headroom(500 * MiB)
    gov = governor(probe)
    assert gov.update() is Band.GREEN
    for value, band in [(399, Band.YELLOW), (199, Band.ORANGE), (99, Band.RED)]:
        probe.value = value * MiB
        assert gov.update() is band
    assert gov.band_changes == 3


def test_recovery_needs_the_hysteresis_margin():
    probe = Headroom(50 * MiB)
    gov = governor(probe)  # margin: 25 MiB
    assert gov.update() is Band.RED
    probe.value = 110 * MiB  # above orange's 100, not above 125
    assert gov.update() is Band.RED
    probe.value = 130 * MiB
    assert gov.update() is Band.ORANGE
    probe.value = 210 * MiB  # above yellow's 200, not 225
    assert gov.update() is Band.ORANGE
    probe.value = 1000 * MiB
    assert gov.update() is Band.GREEN


def test_admission_and_shed_claims():
    probe = Headroom(150 * MiB)
    gov = governor(probe)
    gov.update()
    assert gov.band is Band.ORANGE and not gov.admits_prefill and not gov.claim_shed()
    probe.value = 10 * MiB
    gov.update()
    assert gov.claim_shed() and gov.sheds == 1
    snap = gov.snapshot()
    assert snap["band"] == "red" and snap["sheds"] == 1 and snap["admission_paused"]


def test_disabled_governor_never_restricts():
    gov = governor(Headroom(0), enabled=False)
    assert gov.update() is Band.GREEN and gov.admits_prefill and not gov.claim_shed()
    assert gov.snapshot()["band"] is None


def test_default_floor_bounds():
    assert default_floor(8 * 1024**3) == 512 * MiB
    assert default_floor(64 * 1024**3) == 64 * 1024**3 // 20
    assert default_floor(1024**4) == 4 * 1024**3


def prompt(demo_model, text="governed"):
    return tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": text}]))


def test_orange_holds_new_prefills_and_red_sheds_the_largest(demo_model):
    probe = Headroom(1000 * MiB)
    gov = governor(probe)
    worker = ModelWorker(demo_model, decode_batch=4, governor=gov)
    greedy = SamplingParams(temperature=0)
    try:
        small = worker.submit(GenerateRequest(prompt(demo_model), max_tokens=2000, sampling=greedy))
        big = worker.submit(GenerateRequest(prompt(demo_model, "a much longer prompt " * 20), max_tokens=2000,
                                            sampling=greedy))
        small_events, big_events = iter(small), iter(big)
        next(small_events), next(big_events)  # both decoding

        probe.value = 150 * MiB  # orange: new requests wait, running ones go on
        gov.update(force=True)
        waiting = worker.submit(GenerateRequest(prompt(demo_model), max_tokens=3, sampling=greedy))

        def generated() -> int:
            return next(r["generated"] for r in worker.rows() if r["id"] == small.id)

        # Paced by the running stream, no clock: the worker takes the request from its
        # inbox into its queue, then decodes two more steps without admitting it.
        for _ in small_events:
            if worker.waiting == 1:
                break
        held_at = generated()
        for _ in small_events:
            if generated() >= held_at + 2:
                break
        assert [r["state"] for r in worker.rows() if r["id"] == waiting.id] == ["queued"]
        assert worker.waiting == 1 and worker.in_flight == 2  # held back: reported as waiting

        probe.value = 10 * MiB  # red: the largest running request is shed
        for event in big_events:
            if event.final:
                break
        assert event.finish_reason is FinishReason.SHED
        assert isinstance(event.error, ShedError) and event.error.openai_type == "server_overloaded_shed"
        assert gov.sheds >= 1

        probe.value = 1000 * MiB  # green again: the waiting request runs
        assert list(waiting)[-1].finish_reason is FinishReason.LENGTH
        small.cancel()
        assert list(small_events)[-1].finish_reason in (FinishReason.CANCELLED, FinishReason.SHED)
    finally:
        worker.close()


def test_real_memory_limit_drives_the_governor_to_shed(demo_model):
    """With MLX's memory capped just above what is in use, a long generation's KV
    pushes the real free working set under the floor and the governor sheds it."""
    import mlx.core as mx

    from gmlx.engine import capacity

    mx.synchronize()
    mx.clear_cache()
    active = mx.get_active_memory()
    floor = 2 * MiB
    limit = active + 9 * floor // 4  # yellow now; ~2.5k more tokens of demo KV reach red
    previous = capacity.set_memory_limit(limit)
    try:
        gov = Governor(lambda: capacity.free_bytes(), floor_bytes=floor, interval_s=0.0, shed_cooldown_s=0.0)
        assert gov.update() is Band.YELLOW
        worker = ModelWorker(demo_model, decode_batch=1, governor=gov, prompt_cache_bytes=0)
        try:
            events = list(worker.generate(GenerateRequest(prompt(demo_model, "memory " * 100), max_tokens=6000,
                                                          sampling=SamplingParams(temperature=0))))
        finally:
            worker.close()
        assert events[-1].finish_reason is FinishReason.SHED, events[-1]
        assert gov.sheds == 1
    finally:
        capacity.set_memory_limit(None)
        mx.set_memory_limit(previous)
