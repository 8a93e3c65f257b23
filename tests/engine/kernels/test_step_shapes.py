"""The step kernels' launch shapes at one row (``step_tuning.one_row_shape``): each shape
that agrees timed in a chain over the kernel's layers, the fastest kept per machine, and
the gated (``glu_cuda``) and q-k-v (``qkv_cuda``) kernels bound with it at one stream.
The kernels cannot run here: their ``bound`` and the chain's clock stand in, as said at
each test."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn

from gmlx.engine.kernels import glu_cuda, one_token, qgemv_cuda, qkv_cuda, step_tuning, timing
from tests.engine.kernels.models import tiny

SHAPES = [(4, 4, 1), (8, 4, 1, 1, 1), (4, 2, 1), (16, 2, 1, 2, 1)]


# a chain's own cost, the stand-in clock's, in turn: larger than the calls' differences
OVERHEAD = (3.0, 7.0, 5.0)


def _clock(monkeypatch: pytest.MonkeyPatch, took: dict[tuple[int, ...], list[float]],
           overhead: dict[tuple[int, ...], float] | None = None) -> list[tuple[int, ...]]:
    """``timing.chain_time`` as a run's own cost (:data:`OVERHEAD` in turn, plus
    ``overhead[shape]``) and ``took[shape]``'s next number a call, one number a timing
    (the short and long runs of :func:`timing.per_call`'s rounds), the shape read from
    the bound calls (each records its shape when called); returns the shapes in the
    order they were timed."""
    order: list[tuple[int, ...]] = []
    runs: dict[tuple[int, ...], int] = {}
    per_timing = 2 * timing.ROUNDS

    def chain_time(call, x, reps):
        call(x)
        shape = _last[0]
        runs[shape] = runs.get(shape, 0) + 1
        if runs[shape] % per_timing == 1:
            order.append(shape)
        a_call = took[shape][(runs[shape] - 1) // per_timing]
        return OVERHEAD[runs[shape] % 3] + (overhead or {}).get(shape, 0.0) + a_call * reps

    monkeypatch.setattr(timing, "chain_time", chain_time)
    return order


_last: list[tuple[int, ...]] = [()]


def _calls(shape: tuple[int, ...], layers: int = 3) -> list:
    def call(x, shape=shape):
        _last[0] = shape
        return mx.zeros((1, 1, 64), x.dtype)

    return [call] * layers


def test_the_fastest_shape_that_agrees_is_kept_per_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shape that agrees is timed, the first again last (the lower of its two
    kept); one that disagrees is never timed, however fast; one that does not launch is
    skipped; the choice is kept, so a second load times nothing."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv("GMLX_STEP_SHAPES", raising=False)  # the default: timed
    took = {SHAPES[0]: [9.0, 5.0], SHAPES[1]: [6.0], SHAPES[3]: [7.0]}
    order = _clock(monkeypatch, took)

    def calls(shape):
        if shape == SHAPES[3]:
            raise RuntimeError("NVRTC: too much shared memory")
        return _calls(shape)

    def agrees(call):
        call(mx.zeros((1, 1, 64)))
        return _last[0] != SHAPES[2]

    shape, said = step_tuning.one_row_shape("k:shape", SHAPES, calls, agrees, 64, 4, mx.bfloat16)
    assert order == [SHAPES[0], SHAPES[1], SHAPES[0]]
    assert (shape, said) == (SHAPES[0], "4x4x1: 5000000.0, 8x4x1x1x1: 6000000.0 us")  # the clock's seconds
    again = _clock(monkeypatch, {})
    assert step_tuning.one_row_shape("k:shape", SHAPES, calls, agrees, 64, 4, mx.bfloat16) == (
        SHAPES[0], "from an earlier load")
    assert again == []


def test_a_shape_is_timed_by_its_calls_not_by_its_runs_own_cost(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's own cost (commands encoded before the device starts, clocks rising, the
    last wait) is in its total, not in its calls: the shape whose calls are faster is
    kept though its runs carry more of that cost (here a chain of 32 calls 5 s each
    plus 200 s, against 6 s each plus 0; by totals of 32 calls the second wins)."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv("GMLX_STEP_SHAPES", raising=False)
    shapes = SHAPES[:2]
    order = _clock(monkeypatch, {shapes[0]: [5.0, 5.0], shapes[1]: [6.0]}, overhead={shapes[0]: 200.0})
    shape, said = step_tuning.one_row_shape("k:slope", shapes, _calls, lambda call: True, 64, 4, mx.bfloat16)
    assert order == [shapes[0], shapes[1], shapes[0]]
    assert (shape, said) == (shapes[0], "4x4x1: 5000000.0, 8x4x1x1x1: 6000000.0 us")


def test_close_shapes_are_timed_again_in_turn_and_far_ones_are_not(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each shape is timed once (the first again last), those within
    ``RUNOFF_MARGIN`` of the fastest are timed again in turn, ``RUNOFF_ROUNDS`` times,
    forward then back (the first also last), each keeping its least: here the second
    shape's first timing (5.5) was noise above
    the first's 5.0, its later ones find 4.5, so it is kept; the third (9.0) is far and
    timed once."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv("GMLX_STEP_SHAPES", raising=False)
    three = SHAPES[:3]
    order = _clock(monkeypatch, {three[0]: [5.0, 5.1, 5.2, 5.3], three[1]: [5.5, 4.5, 5.6], three[2]: [9.0]})
    assert timing.runoff({"a": 1.0, "b": 9.0, "c": 1.1}) == ["a", "c", "c", "a"]
    shape, said = step_tuning.one_row_shape("k:runoff", three, _calls, lambda call: True, 64, 4, mx.bfloat16)
    assert order == [three[0], three[1], three[2], three[0], three[0], three[1], three[1], three[0]]
    assert (shape, said) == (three[1], "4x4x1: 5000000.0, 8x4x1x1x1: 4500000.0, 4x2x1: 9000000.0 us")
    assert timing.runoff({three[0]: 1.0}) == []  # one shape: nothing to decide
    assert timing.runoff({}) == []


def test_a_call_is_the_slope_between_a_short_and_a_long_run() -> None:
    """:func:`timing.per_call`: the least of each length's runs (taken in turn), their
    difference over the calls between them; where noise makes that slope not positive,
    the long run's time a call."""
    runs: list[int] = []

    def run(n: int) -> float:
        runs.append(n)
        return (9.0, 2.0, 4.0)[len(runs) % 3] + 0.5 * n

    assert timing.per_call(run, 8) == pytest.approx(0.5)
    assert runs == [8, 32] * timing.ROUNDS
    assert timing.per_call(lambda n: 100.0 if n == 32 else 101.0, 8) == pytest.approx(100.0 / 32)


def test_no_shape_that_agrees_leaves_the_first(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.setenv("GMLX_STEP_SHAPES", "1")
    order = _clock(monkeypatch, {})
    shape, _ = step_tuning.one_row_shape("k:shape", SHAPES, _calls, lambda call: False, 64, 4, mx.bfloat16)
    assert shape == SHAPES[0] and order == []


def test_the_gated_kernel_takes_the_timed_shape_at_one_stream(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``glu_cuda.tune`` times the one-row shape once per MLP shape, over all the MLPs of
    that shape (the gated ``bound`` standing in, recording what it binds), before the
    buckets are decided; the kernel then binds that shape at one stream and the default
    at two."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(glu_cuda.ENV, raising=False)
    monkeypatch.setenv("GMLX_STEP_SHAPES", "1")
    model = tiny("llama", 2, quantized=True, dtype=mx.bfloat16, seed=11)
    glu_cuda.attach(model, buckets=())
    bound: list[tuple] = []

    def fake_bound(w, scales, biases, group_size, bits, config, up, stacked=None):
        bound.append((config, w.shape))
        return lambda x: mx.zeros((*x.shape[:-1], w.shape[0]), x.dtype)

    timed: list[tuple] = []

    def one_row_shape(key, shapes, calls, agrees, k, bits, dtype):
        timed.append((key, shapes, bits, len(calls(shapes[1]))))
        return shapes[1], "timed"

    monkeypatch.setattr(glu_cuda.qgemv_cuda, "bound", fake_bound)
    monkeypatch.setattr(glu_cuda, "_shapes", {})  # the process's choices, this test's alone
    monkeypatch.setattr(step_tuning, "one_row_shape", one_row_shape)
    monkeypatch.setattr(step_tuning, "decide", lambda model, key, agrees, use: use({1, 2}) or {})
    glu_cuda.tune(model)
    mlps = glu_cuda.fused(model)
    k = mlps[0].gate_proj.weight.shape[1] * 32 // 4
    assert timed == [(f"{glu_cuda._key(mlps[0])}:{glu_cuda.ENV}:shape", qgemv_cuda.gated_configs(1, k), 4, 2)]
    bound.clear()
    for rows in (1, 2):
        mlps[0]._gated(mlps[0], mx.zeros((rows, 1, k), mx.bfloat16), rows)
    assert [c for c, _ in bound] == [qgemv_cuda.gated_configs(1, k)[1], qgemv_cuda.gated_configs(2)[0]]


def test_the_qkv_product_takes_the_timed_shape_at_one_stream(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Likewise for the queries, keys and values in one product (their ``bound``
    standing in)."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(qkv_cuda.ENV, raising=False)
    monkeypatch.setenv("GMLX_STEP_SHAPES", "1")
    model = tiny("llama", 2, dtype=mx.bfloat16, seed=13)
    nn.quantize(model, group_size=32, bits=4)
    one_token.attach(model, rotation=lambda attention: None)
    qkv_cuda.attach(model, buckets=())
    bound: list[tuple] = []

    def fake_bound(w, scales, biases, group_size, bits, config, more, heads=(), stacked=None):
        bound.append(config)
        return lambda x: tuple(mx.zeros((*x.shape[:-1], a.shape[0]), x.dtype) for a in (w, *(m[0] for m in more)))

    def one_row_shape(key, shapes, calls, agrees, k, bits, dtype):
        assert len(calls(shapes[-1])) == 2 and bits == 4
        return shapes[-1], "timed"

    monkeypatch.setattr(qkv_cuda.qgemv_cuda, "bound", fake_bound)
    monkeypatch.setattr(qkv_cuda, "_shapes", {})
    monkeypatch.setattr(step_tuning, "one_row_shape", one_row_shape)
    monkeypatch.setattr(step_tuning, "decide", lambda model, key, agrees, use: use({1, 2}) or {})
    qkv_cuda.tune(model)
    attention = qkv_cuda.projected(model)[0]
    k = attention.q_proj.weight.shape[1] * 32 // 4
    bound.clear()
    for rows in (1, 2):
        attention._project(attention, mx.zeros((rows, 1, k), mx.bfloat16), rows)
    assert bound == [qgemv_cuda.configs(1, k)[-1], qgemv_cuda.configs(2)[0]]


def test_a_choice_is_kept_apart_only_where_the_product_rounds_x(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With x rounded to bytes (``GMLX_Q8X=1``, the default where the products run on
    CUDA) a 4-bit product's choice is kept under a key of its own (``:q8``), its kernel
    not the float sums'; a 6-bit product's is not, its kernel the same either way: a
    load with ``GMLX_Q8X=0`` reads it. ``GMLX_Q8X=all`` rounds the 6-bit one's x too."""
    from gmlx.engine.kernels import qgemv_q8
    from gmlx.engine.kernels.tuning import Tuning

    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv("GMLX_STEP_SHAPES", raising=False)
    monkeypatch.setenv(qgemv_q8.ENV, "1")
    _clock(monkeypatch, {SHAPES[0]: [9.0, 9.0], SHAPES[2]: [1.0]})
    assert step_tuning.one_row_shape("k6:shape", [SHAPES[0], SHAPES[2]], _calls, lambda call: True, 64, 6,
                                     mx.bfloat16)[0] == SHAPES[2]
    _clock(monkeypatch, {SHAPES[0]: [9.0, 9.0], SHAPES[2]: [1.0]})
    assert step_tuning.one_row_shape("k4:shape", [SHAPES[0], SHAPES[2]], _calls, lambda call: True, 64, 4,
                                     mx.bfloat16)[0] == SHAPES[2]
    kept = Tuning()
    assert kept.layer("k6:shape") == {1: ("gemv", SHAPES[2])} and kept.layer("k6:shape:q8") is None
    assert kept.layer("k4:shape:q8") == {1: ("gemv", SHAPES[2])} and kept.layer("k4:shape") is None
    monkeypatch.setenv(qgemv_q8.ENV, "0")
    assert step_tuning.one_row_shape("k6:shape", [SHAPES[0], SHAPES[2]], _calls, lambda call: True, 64, 6,
                                     mx.bfloat16) == (SHAPES[2], "from an earlier load")
    monkeypatch.setenv(qgemv_q8.ENV, "all")
    _clock(monkeypatch, {SHAPES[0]: [1.0, 1.0], SHAPES[2]: [9.0]})
    assert step_tuning.one_row_shape("k6:shape", [SHAPES[0], SHAPES[2]], _calls, lambda call: True, 64, 6,
                                     mx.bfloat16)[0] == SHAPES[0]
    assert Tuning().layer("k6:shape:q8") == {1: ("gemv", SHAPES[0])}


def test_with_step_shapes_off_the_first_shape_is_taken_untimed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GMLX_STEP_SHAPES=0``: the first shape, nothing timed, nothing kept."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.setenv("GMLX_STEP_SHAPES", "0")
    order = _clock(monkeypatch, {})
    assert step_tuning.one_row_shape("k:shape", SHAPES, _calls, lambda call: True, 64, 4, mx.bfloat16)[0] == SHAPES[0]
    assert order == [] and not (tmp_path / "cache").exists()


def test_staged_shapes_only_where_asked_else_their_unstaged_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GMLX_STAGED=1`` offers the staged shapes (where a row fits); without it none is
    offered, and a kept one launches unstaged (the same warps, rows a warp and depth)."""
    monkeypatch.setenv(qgemv_cuda.STAGED_ENV, "1")
    assert qgemv_cuda.STAGED[0] in qgemv_cuda.configs(1, 4096)
    assert not any(len(c) > 4 for c in qgemv_cuda.configs(1, 32768))  # x does not fit
    monkeypatch.delenv(qgemv_cuda.STAGED_ENV)
    assert not any(len(c) > 4 for c in qgemv_cuda.configs(1, 4096) + qgemv_cuda.gated_configs(1, 4096))
    assert qgemv_cuda.unstaged((16, 2, 1, 2, 1)) == (16, 2, 1, 2)
    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or (lambda **launch: [launch]))
    qgemv_cuda._kernel.cache_clear()
    try:
        w, s, b = mx.quantize(mx.zeros((16, 4096)), group_size=32, bits=4)
        launch = qgemv_cuda.bound(w, s, b, 32, 4, (8, 2, 1, 1, 2))(mx.zeros((1, 4096), mx.bfloat16))
    finally:
        qgemv_cuda._kernel.cache_clear()
    assert "xs4" not in made[0]["source"] and launch["grid"] == (32 * 8, 1, 1)  # 16 rows: one block of 8 x 2


def test_device_shapes_take_the_device_timer_and_keep_their_own_choice(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GMLX_STEP_SHAPES=device`` times each shape with ``timing.device_chain_time`` (the
    chain's clock stands in) and keeps its choice under a key of its own: a later load
    with the plain chain times again, and a device load after it reads its own choice."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.setenv("GMLX_STEP_SHAPES", "device")
    plain = _clock(monkeypatch, {SHAPES[0]: [9.0, 9.0], SHAPES[1]: [1.0], SHAPES[2]: [5.0]})
    device: list[tuple[int, ...]] = []

    def device_chain_time(call, x, reps):
        call(x)
        device.append(_last[0])
        return {SHAPES[0]: 4.0, SHAPES[1]: 8.0, SHAPES[2]: 6.0}[_last[0]] * reps

    monkeypatch.setattr(timing, "device_chain_time", device_chain_time)
    three = SHAPES[:3]
    shape, said = step_tuning.one_row_shape("k:shape", three, _calls, lambda call: True, 64, 4, mx.bfloat16)
    assert shape == SHAPES[0] and plain == [] and device == [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[0]]
    assert said.endswith("us, the device's part")
    monkeypatch.setenv("GMLX_STEP_SHAPES", "1")  # the chain's own choice is not the device's
    assert step_tuning.one_row_shape("k:shape", three, _calls, lambda call: True, 64, 4, mx.bfloat16)[0] == SHAPES[1]
    assert plain == [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[0]]
    monkeypatch.setenv("GMLX_STEP_SHAPES", "device")
    assert step_tuning.one_row_shape("k:shape", three, _calls, lambda call: True, 64, 4, mx.bfloat16) == (
        SHAPES[0], "from an earlier load")


def test_a_lead_is_sized_to_twice_the_time_it_must_cover(monkeypatch: pytest.MonkeyPatch) -> None:
    """``timing.lead_for`` grows its product until the device takes at least twice the
    seconds asked over it (here the CPU backend's clock, a few milliseconds); none where
    its largest product (100 rows here, a stand-in clock) is still shorter, that size
    tried where growing would pass it."""
    lead, alone = timing.lead_for(0.004, mx.float32)
    assert alone >= 0.008
    out = lead()
    assert out.shape[1] == timing.LEAD_K and out.dtype == mx.float32
    monkeypatch.setattr(timing, "LEAD_ROWS", 100)
    tried: list[int] = []  # a clock that finds every lead a millisecond long: each size timed twice
    monkeypatch.setattr(timing, "_once", lambda call: tried.append(call().shape[0]) or 1e-3)
    assert timing.lead_for(1.0, mx.float32) is None
    assert tried == [1, 1, 64, 64, 100, 100]  # grown at most 64-fold, the largest tried at its size


def test_the_device_part_is_what_the_chain_adds_behind_the_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    """``timing.device_chain_time``: per round the lead timed alone, then the chain built,
    the lead handed over first and the chain waited for behind it; the median of the
    rounds' differences (not the least: that is the lead's jitter); where that is nothing
    (the clock's noise) or no lead is long enough, the plain chain's time. The clock stands
    in (seconds: the lead alone 0.6; behind it 0.9, 0.7 and 1.5: differences 0.3, 0.1,
    0.9, median 0.3)."""
    calls: list[int] = []

    def call(y):
        calls.append(1)
        return y + 1

    monkeypatch.setattr(timing, "chain_time", lambda call, x, reps: 0.25)
    handed: list[str] = []
    monkeypatch.setattr(timing, "lead_for", lambda seconds, dtype: (lambda: handed.append("lead") or mx.zeros(1), 0.6))

    def clock(*pairs: tuple[float, float]):
        """The clock's readings for rounds of (lead alone, chain behind the lead)."""
        ticks = iter([t for alone, behind in pairs for t in (0.0, alone, 10.0, 10.0 + behind)])
        monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))

    assert timing.DEVICE_ROUNDS == 3
    clock((0.6, 0.9), (0.6, 0.7), (0.6, 1.5))
    assert timing.device_chain_time(call, mx.zeros(4), 5) == pytest.approx(0.3)
    assert len(calls) == 15 and handed == ["lead"] * 6  # a chain built each round; the lead alone and ahead of it
    clock((0.6, 0.5), (0.6, 0.6), (0.6, 0.9))  # median nothing left: noise
    assert timing.device_chain_time(call, mx.zeros(4), 5) == 0.25
    monkeypatch.setattr(timing, "lead_for", lambda seconds, dtype: None)
    assert timing.device_chain_time(call, mx.zeros(4), 5) == 0.25


def test_a_candidate_set_with_split_shapes_keeps_its_choice_apart(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the shapes timed include one that splits K between warps (``GMLX_SPLIT_K=1``
    adds them), the choice is kept under a key of its own: a load without them times
    again rather than read a split shape it would not have timed."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv("GMLX_STEP_SHAPES", raising=False)
    split = (4, 4, 1, 1, 0, 4)
    order = _clock(monkeypatch, {SHAPES[0]: [9.0, 9.0], split: [1.0]})
    assert step_tuning.one_row_shape("k:shape", [SHAPES[0], split], _calls, lambda call: True, 64, 4,
                                     mx.bfloat16)[0] == split
    order.clear()
    _clock(monkeypatch, {SHAPES[0]: [3.0, 3.0], SHAPES[2]: [5.0]})
    assert step_tuning.one_row_shape("k:shape", [SHAPES[0], SHAPES[2]], _calls, lambda call: True, 64, 4,
                                     mx.bfloat16)[0] == SHAPES[0]
