"""Many models in one registry: the load gate, eviction, idle unload, keep, unload and
reload, on demo-sized models with scripted free memory and a scripted clock.

The :class:`Machine` below is the memory a registry sees: a budget less one demo
model's price for every resident worker, so two demo models fit and a third needs
room. The :class:`Clock` moves only when a test moves it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gmlx.engine import sizing
from gmlx.engine.errors import (
    ModelBusyError,
    ModelLoadDeferredError,
    ModelNotFoundError,
    ModelSourceError,
)
from gmlx.engine.governor import Governor
from gmlx.engine.residency import ModelSpec, Registry
from gmlx.engine.types import GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker

FLOOR = 1 << 20  # the governor's floor the gate keeps free
WIDTH = 2  # every worker's decode width, which the gate prices KV for


@pytest.fixture(scope="module")
def need(gmlx_home: Path) -> int:
    """What one demo model costs the gate: weights + KV of WIDTH x 2048 tokens."""
    return sizing.source_size("demo").need_bytes(WIDTH)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Machine:
    """Free memory: ``budget`` less ``need`` per resident worker. ``slow(n)`` makes the
    next ``n`` measurements miss one model's worth, as while the kernel is still
    returning an unloaded model's pages."""

    def __init__(self, budget: int, need: int) -> None:
        self.budget = budget
        self.need = need
        self.registry: Registry | None = None
        self.polls = 0
        self._lagging = 0

    def __call__(self) -> int:
        self.polls += 1
        held = self.need * len(self.registry.workers()) if self.registry else 0
        lag = self.need if self._lagging > 0 else 0
        self._lagging = max(0, self._lagging - 1)
        return self.budget - held - lag

    def slow(self, polls: int) -> None:
        self._lagging = polls


def make_registry(
    need: int, *specs: ModelSpec, room_for: float = 2.5, **kwargs: object
) -> tuple[Registry, Machine, Clock]:
    """A registry of ``specs`` on a machine with room for ``room_for`` demo models."""
    machine = Machine(FLOOR + int(room_for * need), need)
    clock = Clock()
    options: dict[str, object] = {
        "decode_batch": WIDTH,
        "prompt_cache_bytes": 0,
        # Bands stay green: the workers never hold prefills back while the gate
        # judges the scripted numbers against this floor.
        "governor": Governor(lambda: 10**12, floor_bytes=FLOOR),
        "probe": machine,
        "clock": clock,
        "gate_wait_s": 0.3,
        **kwargs,
    }
    registry = Registry(specs, **options)  # type: ignore[arg-type]
    machine.registry = registry
    return registry, machine, clock


@pytest.fixture
def closing() -> Iterator[list[Registry]]:
    registries: list[Registry] = []
    yield registries
    for registry in registries:
        registry.close()


def demo(model_id: str, **fields: object) -> ModelSpec:
    return ModelSpec(model_id, "demo", **fields)  # type: ignore[arg-type]


def resident(registry: Registry) -> set[str]:
    return {m.id for m in registry.listing() if m.resident and m.alias_of is None}


@contextmanager
def streaming(worker: ModelWorker) -> Iterator[None]:
    """A long request generating on ``worker`` for the duration of the block."""
    tok = worker.loaded.tokenizer
    never_stop = {t: -100.0 for t in tok.eos_token_ids}
    request = GenerateRequest(
        tuple(tok.encode("Hello, world")),
        max_tokens=4000,
        sampling=SamplingParams(temperature=0.0, logit_bias=never_stop),
    )
    handle = worker.submit(request)
    deadline = time.monotonic() + 10
    while worker.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        yield
    finally:
        worker.cancel(handle.id)
        for _ in handle:
            pass


# -- the load gate -------------------------------------------------------------------


def test_least_recently_used_idle_model_makes_room(need, closing):
    reg, _, clock = make_registry(need, demo("a"), demo("b"), demo("c"))
    closing.append(reg)
    reg.worker("a")
    clock.advance(10)
    reg.worker("b")
    clock.advance(10)
    reg.touch("a")  # a is now the more recent
    clock.advance(10)
    reg.worker("c")
    assert resident(reg) == {"a", "c"}
    clock.advance(10)
    reg.worker("b")  # c was used after a, so a goes
    assert resident(reg) == {"b", "c"}


def test_pinned_and_streaming_models_never_make_room(need, closing):
    reg, _, clock = make_registry(need, demo("p", pinned=True), demo("a"), demo("b"))
    closing.append(reg)
    reg.preload()  # the pinned one
    assert resident(reg) == {"p"}
    clock.advance(10)
    a = reg.worker("a")
    clock.advance(10)
    with streaming(a):
        with pytest.raises(ModelLoadDeferredError) as info:
            reg.worker("b")
        assert reg.workers() and resident(reg) == {"p", "a"}
    err = info.value
    assert err.status == 503 and err.openai_type == "model_load_deferred"
    assert err.anthropic_type == "overloaded_error"
    assert 2 <= int(err.headers["Retry-After"]) <= 60
    free = FLOOR + int(0.5 * need)
    for figure in (need, free, FLOOR):
        assert f"({figure} bytes" in err.message
    assert "MiB" in err.message and "p (pinned)" in err.message and "a (busy)" in err.message
    assert (err.extra["need_bytes"], err.extra["free_bytes"], err.extra["floor_bytes"]) == (
        need,
        free,
        FLOOR,
    )
    assert reg.loading() == [] and not reg.resident("b")
    clock.advance(10)
    reg.worker("b")  # a finished: it is idle now, so it makes room
    assert resident(reg) == {"p", "b"}


def test_a_model_just_used_is_waited_for_not_unloaded(need, closing):
    reg, _, clock = make_registry(need, demo("a"), demo("b"), demo("c"))
    closing.append(reg)
    reg.worker("a")
    reg.worker("b")  # both used "now": a request may be on its way to either
    with pytest.raises(ModelLoadDeferredError, match=r"a \(just used\)"):
        reg.worker("c")
    clock.advance(5)
    reg.worker("c")
    assert resident(reg) == {"b", "c"}


def test_kept_model_goes_last_but_goes_under_pressure(need, closing):
    reg, _, clock = make_registry(need, demo("k"), demo("a"), demo("p", pinned=True))
    closing.append(reg)
    assert reg.keep("k", warm=False).kept
    clock.advance(10)
    reg.worker("a")
    clock.advance(10)
    reg.worker("p")  # k is older, but a is not kept: a goes
    assert resident(reg) == {"k", "p"}
    clock.advance(10)
    reg.worker("a")  # only k can go, and it does, kept or not
    assert resident(reg) == {"a", "p"}
    assert not reg.kept("k")


def test_the_gate_waits_for_memory_still_returning(need, closing):
    reg, machine, clock = make_registry(need, demo("p", pinned=True), demo("a"), demo("b"))
    closing.append(reg)
    reg.worker("p")
    reg.worker("a")
    assert reg.unload("a")
    machine.slow(3)  # the next measurements miss the unloaded model's memory
    polls = machine.polls
    reg.worker("b")
    assert resident(reg) == {"p", "b"} and machine.polls - polls >= 4
    # Long after any unload nothing is on its way back, and only a pinned model is
    # left: the refusal comes at once.
    reg.unload("b")
    clock.advance(60)
    machine.budget -= need  # something else took the memory meanwhile
    started = time.monotonic()
    with pytest.raises(ModelLoadDeferredError, match=r"p \(pinned\)"):
        reg.worker("a")
    assert time.monotonic() - started < 0.2


def test_overcommit_skips_the_gate(need, closing):
    reg, _, _ = make_registry(need, demo("a"), demo("b"), demo("c"), room_for=1, overcommit=True)
    closing.append(reg)
    for model_id in "abc":
        reg.worker(model_id)
    assert resident(reg) == {"a", "b", "c"}


# -- loading once, failing cleanly -------------------------------------------------------


def test_concurrent_first_requests_load_once(need, closing, monkeypatch):
    from gmlx.engine import loading

    calls: list[str] = []
    real = loading.load_model
    started = threading.Event()

    def slow_load(source: str, *, model_id: str | None = None, mmproj: str | None = None):
        calls.append(model_id or source)
        started.set()
        time.sleep(0.3)
        return real(source, model_id=model_id, mmproj=mmproj)

    monkeypatch.setattr(loading, "load_model", slow_load)
    reg, _, _ = make_registry(need, demo("a"))
    closing.append(reg)
    got: list[ModelWorker] = []
    threads = [threading.Thread(target=lambda: got.append(reg.worker("a"))) for _ in range(6)]
    for t in threads:
        t.start()
    started.wait(5)
    assert reg.loading() == ["a"]
    for t in threads:
        t.join()
    assert calls == ["a"] and len(got) == 6 and len({id(w) for w in got}) == 1
    assert reg.loading() == []


def test_a_failed_load_fails_every_waiter_and_leaves_nothing(need, closing, monkeypatch):
    from gmlx.engine import loading

    calls: list[str] = []

    def broken(source: str, *, model_id: str | None = None, mmproj: str | None = None):
        calls.append(source)
        time.sleep(0.2)
        raise ModelSourceError(f"Model path {source} does not exist.")

    monkeypatch.setattr(loading, "load_model", broken)
    reg, _, _ = make_registry(need, ModelSpec("bad", "/no/such/model.gguf"))
    closing.append(reg)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            reg.worker("bad")
        except ModelSourceError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and calls == ["/no/such/model.gguf"]
    assert reg.loading() == [] and reg.workers() == [] and not reg.resident("bad")
    assert reg.geometry("bad") is None and reg.capacity is None
    with pytest.raises(ModelSourceError):
        reg.worker("bad")  # the next request tries again
    assert len(calls) == 2
    with pytest.raises(ModelNotFoundError):
        reg.worker("nope")


# -- idle unload, keep, unload -----------------------------------------------------------


def test_reap_unloads_models_idle_past_their_timeout(need, closing):
    specs = [demo("d"), demo("short", idle_timeout=10), demo("never", idle_timeout=0)]
    reg, _, clock = make_registry(need, *specs, room_for=5, idle_timeout=60)
    closing.append(reg)
    for model_id in ("d", "short", "never"):
        reg.worker(model_id)
    short = reg.resident_worker("short")
    clock.advance(30)
    with streaming(short):
        assert reg.reap() == []  # seen streaming: used now
    assert reg.last_used("short") == clock.now
    clock.advance(11)
    assert reg.reap() == ["short"]
    clock.advance(60)
    assert reg.reap() == ["d"]
    clock.advance(10_000)
    assert reg.reap() == [] and resident(reg) == {"never"}


def test_keep_and_release(need, closing):
    reg, _, clock = make_registry(need, demo("a"), demo("p", pinned=True), idle_timeout=5)
    closing.append(reg)
    released = reg.keep("a", keep=False)
    assert (released.kept, released.resident, released.loaded) == (False, False, False)
    assert reg.workers() == []  # releasing never loads
    kept = reg.keep("a", warm=False)
    assert (kept.kept, kept.resident, kept.loaded, kept.warmed_s) == (True, True, True, None)
    warmed = reg.keep("a")
    assert warmed.loaded is False and warmed.warmed_s is not None
    assert reg.keep("a").warmed_s is None  # warmed once
    reg.worker("p")
    clock.advance(100)
    assert reg.reap() == [] and reg.kept("a")
    assert reg.keep("a", keep=False).resident
    assert reg.reap() == ["a"] and resident(reg) == {"p"}


def test_unload_refuses_a_streaming_model(need, closing):
    reg, _, _ = make_registry(need, demo("a"), demo("p", pinned=True), demo("b"))
    closing.append(reg)
    a = reg.worker("a")
    reg.worker("p")
    with streaming(a):
        with pytest.raises(ModelBusyError) as info:
            reg.unload("a")
        assert info.value.status == 409 and info.value.openai_type == "model_busy"
        assert info.value.anthropic_type == "invalid_request_error"
        assert reg.unload_idle() == ["p"]  # pinned too; a streams
    assert reg.unload("a") is True and reg.unload("a") is False
    with pytest.raises(ModelNotFoundError):
        reg.unload("nope")
    reg.worker("p")  # a pinned model unloaded by hand stays pinned and loads again
    assert reg.listing()[1].pinned and reg.resident("p")


# -- reload -------------------------------------------------------------------------


def test_reconfigure_keeps_unchanged_models_resident(need, closing):
    reg, _, _ = make_registry(need, demo("a"), demo("b"), demo("c"), demo("gone"), room_for=6)
    closing.append(reg)
    a, b, c, gone = (reg.worker(i) for i in ("a", "b", "c", "gone"))
    with streaming(b):
        result = reg.reconfigure(
            [demo("a", profile="chat"), demo("b", max_kv_size=512), demo("c"), demo("new")],
            aliases={"fast": "a"},
        )
        assert (result.added, result.removed) == (["new"], ["gone"])
        assert (result.changed, result.unchanged) == (["b"], ["a", "c"])
        assert reg.resident_worker("a") is a and reg.resident_worker("c") is c
        assert reg.specs["a"].profile == "chat" and reg.address("fast").spec.id == "a"
        assert not reg.resident("gone") and gone not in reg.workers()  # idle: gone now
        assert not reg.resident("b") and b in reg.workers()  # streaming: serves on
        with pytest.raises(ModelNotFoundError):
            reg.address("gone")
        fresh = reg.worker("b")  # the changed model loads anew, beside the old one
        assert fresh is not b and fresh.loaded.context_length == 512
    assert reg.reap() == ["b"] and b not in reg.workers() and reg.resident_worker("b") is fresh
    with pytest.raises(ValueError):
        reg.reconfigure([demo("a")], aliases={"x": "missing"})
    assert "new" in reg.specs  # a bad reload changes nothing


# -- what never loads or counts as use ------------------------------------------------


def test_listing_and_lookups_never_load_or_touch(need, closing, monkeypatch):
    reg, _, clock = make_registry(need, demo("a"), demo("b", max_kv_size=1024), aliases={"x": "a"})
    closing.append(reg)
    a, b, x = reg.listing()
    assert (a.resident, a.context_length, a.weight_bytes, a.idle_s) == (False, 8192, None, None)
    assert b.context_length == 1024 and x.alias_of == "a"
    assert reg.workers() == [] and reg.resident_worker("a") is None and reg.geometry("a") is None
    reg.worker("a")
    used = reg.last_used("a")
    clock.advance(42)
    lookups = [reg.listing, reg.workers, reg.free_bytes, reg.running_kv_bytes]
    lookups += [lambda: reg.resident_worker("a"), lambda: reg.running("a")]
    lookups += [lambda: reg.geometry("a"), lambda: reg.kept("a")]
    for lookup in lookups:
        lookup()
    assert reg.last_used("a") == used
    row = reg.listing()[0]
    assert row.resident and row.idle_s == 42 and row.kept is False
    assert row.in_flight == 0 and row.waiting == 0 and row.weight_bytes and row.weight_bytes > 0
    assert reg.capacity_model == "a" and reg.capacity is not None
    reg.unload("a")
    assert reg.capacity is None and reg.capacity_model is None  # the next load builds it
    reg.worker("b")
    assert reg.capacity_model == "b"


def test_the_reaper_thread(need, closing):
    reg, _, clock = make_registry(need, demo("a"), idle_timeout=1)
    closing.append(reg)
    reg.worker("a")
    reg.start_reaper(interval_s=0.02)
    clock.advance(5)
    deadline = time.monotonic() + 5
    while reg.resident("a") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not reg.resident("a")
    reg.close()


# -- pricing -------------------------------------------------------------------------


def test_source_size_of_the_demo_model(gmlx_home):
    from gmlx.engine.loading import demo as demo_source

    size = sizing.source_size("demo")
    folder = demo_source.ensure_built()
    assert size.weight_bytes == sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert size.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # layers, kv heads, head dim, fp32
    assert size.context_length == 8192
    assert size.need_bytes(4) == size.weight_bytes + 1024 * sizing.LOAD_KV_TOKENS * 4
    assert size.kv_bytes(1, max_kv_size=512) == 1024 * 512


def test_source_size_of_a_gguf_reads_only_its_header(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    def write(path: Path, arch: str) -> Path:
        writer = GGUFWriter(str(path), arch)
        writer.add_block_count(3)
        writer.add_context_length(4096)
        writer.add_embedding_length(128)
        writer.add_feed_forward_length(256)
        writer.add_head_count(4)
        writer.add_head_count_kv(2)
        writer.add_key_length(64)
        writer.add_tensor("token_embd.weight", np.zeros((16, 128), dtype=np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    llama = write(tmp_path / "tiny.gguf", "llama")
    size = sizing.source_size(str(llama))
    assert size.weight_bytes == llama.stat().st_size
    assert size.kv_bytes_per_token == 2 * 3 * 2 * 64 * 2 and size.context_length == 4096
    unknown = sizing.source_size(str(write(tmp_path / "odd.gguf", "mamba9")))
    assert unknown.kv_bytes_per_token is None and unknown.context_length == 4096
    with pytest.raises(ModelSourceError):
        sizing.source_size(str(tmp_path / "missing.gguf"))
