"""An MLP's gate and up projections and swiglu in one kernel (``glu_cuda``): which MLPs
take it, and the wiring through real llama-pattern models with MLX's own products and
swiglu standing in for the kernel (the same logits, bit for bit: the wiring changes
nothing else). The kernel's own source is run on the CPU against MLX's products and
swiglu in ``test_qgemv_cuda.py``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from gmlx.engine.kernels import glu_cuda
from tests.engine.kernels.models import step_clock, steps, tiny

LAYERS = 2


def _model(family: str) -> nn.Module:
    return tiny(family, LAYERS, quantized=True, dtype=mx.bfloat16, seed=11)


@pytest.mark.parametrize("family", glu_cuda.FAMILIES)
@pytest.mark.parametrize("streams", [1, 3, 9])
def test_the_wiring_gives_the_same_logits(family: str, streams: int) -> None:
    """With MLX's products and swiglu in the kernel's place the model computes what it
    computed; the fused path takes one-token steps of up to eight streams, never a
    prompt, nor a step of more streams."""
    model = _model(family)
    prompts = mx.array([[3, 1, 4, 1, 5, 9][i % 3:] + [2] * (i % 3) for i in range(streams)])

    def caches() -> list:
        return [BatchKVCache([0] * streams) for _ in range(LAYERS)] if streams > 1 else make_prompt_cache(model)

    want = steps(model, caches(), prompts)
    calls: list[tuple[tuple[int, ...], int]] = []

    def make(mlp):
        gated = glu_cuda.mlx_gated(mlp)

        def recorded(mlp, x, rows):
            calls.append((tuple(x.shape), rows))
            return gated(mlp, x, rows)

        return recorded

    assert glu_cuda.attach(model, make) == LAYERS
    got = steps(model, caches(), prompts)
    for a, b in zip(want, got, strict=True):
        assert mx.array_equal(a, b).item()
    expected = [((streams, 1, 128), streams)] * LAYERS * 4 if streams <= glu_cuda.MAX_ROWS else []
    assert calls == expected
    glu_cuda.detach(model)
    assert not any(vars(type(m)).get("glu") for _, m in model.named_modules())


def test_only_projections_quantized_alike_take_it() -> None:
    """Gate and up in different bit widths, float projections, or projections with a
    bias keep the model's own MLP."""
    mixed = tiny("llama", LAYERS, dtype=mx.bfloat16)
    nn.quantize(mixed, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and not p.endswith("up_proj"))
    nn.quantize(mixed, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("up_proj"))
    assert glu_cuda.attach(mixed) == 0
    assert glu_cuda.attach(tiny("llama", LAYERS, dtype=mx.bfloat16)) == 0
    assert glu_cuda.layout(_model("qwen2").layers[0].mlp) == (32, 4)


def test_each_row_bucket_binds_the_gated_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's function binds the gated product per bucket of streams, with the up
    projection's weights beside the gate's, once each: the CUDA-core source at 1 and 2
    streams, the tensor-core one at 4 to 64. (The kernels' ``bound`` stand in: CUDA
    cannot run here.)"""
    mlp = _model("llama").layers[0].mlp
    bound: list[tuple] = []

    def binder(name: str):
        def fake_bound(w, scales, biases, group_size, bits, config, up, stacked=None):
            bound.append((name, config))
            assert up[0] is mlp.up_proj.weight and w is mlp.gate_proj.weight
            return lambda x: mx.zeros((*x.shape[:-1], w.shape[0]), x.dtype)
        return fake_bound

    monkeypatch.setattr(glu_cuda.qgemv_cuda, "bound", binder("gemv"))
    monkeypatch.setattr(glu_cuda.qmmw_cuda, "bound", binder("tensor cores"))
    gated = glu_cuda.kernel(mlp)
    for rows in (1, 1, 2, 3, 4, 5, 8, 20, 33, 64):
        assert gated(mlp, mx.zeros((rows, 1, 128), mx.bfloat16), rows).shape == (rows, 1, 128)
    assert bound == ([("gemv", glu_cuda.qgemv_cuda.gated_configs(n)[0]) for n in (1, 2)]
                     + [("tensor cores", glu_cuda.qmmw_cuda.configs(n, gated=True)[0]) for n in (4, 8, 32, 64)])


def test_a_bucket_whose_gate_product_took_tensor_cores_takes_them_gated(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one or two streams the gated product follows the gate projection's own tuned
    path: the tensor-core source where the load's tuner gave the gate's product that
    kernel at the bucket, else the CUDA-core one."""
    mlp = _model("llama").layers[0].mlp
    bound: list[str] = []

    def binder(name: str):
        def fake_bound(w, scales, biases, group_size, bits, config, up, stacked=None):
            bound.append(name)
            return lambda x: mx.zeros((*x.shape[:-1], w.shape[0]), x.dtype)
        return fake_bound

    monkeypatch.setattr(glu_cuda.qgemv_cuda, "bound", binder("gemv"))
    monkeypatch.setattr(glu_cuda.qmmw_cuda, "bound", binder("tensor cores"))
    object.__setattr__(mlp.gate_proj, "paths", {1: ("kernel", (1, 8, 2)), 2: ("gemv", (4, 2, 2))})
    gated = glu_cuda.kernel(mlp)
    for rows in (1, 2):
        gated(mlp, mx.zeros((rows, 1, 128), mx.bfloat16), rows)
    assert bound == ["tensor cores", "gemv"]


def _timed(monkeypatch: pytest.MonkeyPatch, faster: dict[int, float], drift: float = 0.0) -> list[tuple[int, bool]]:
    """Whole steps timed 1.0 s, ``faster[rows]`` with the fused path taken."""
    return step_clock(monkeypatch, lambda model, rows: any(glu_cuda.bucket(rows) in m._buckets
                                                           for m in glu_cuda.fused(model)), faster, drift)


def test_tuning_keeps_the_buckets_whose_whole_step_got_faster(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bucket's step is timed with and without the fused path; a bucket keeps it
    only 2% faster or more; the answer is kept per machine, so a second load times
    nothing."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(glu_cuda.ENV, raising=False)
    model = _model("llama")
    assert glu_cuda.attach(model, glu_cuda.mlx_gated, buckets=()) == LAYERS
    timed = _timed(monkeypatch, {1: 0.8, 2: 0.99, 4: 0.9, 8: 1.2})
    note = glu_cuda.tune(model)
    assert timed == [(b, on) for b in glu_cuda.BUCKETS for on in (False, True, True, False)]
    assert all(m._buckets == {1, 4} for m in glu_cuda.fused(model))
    assert "1: 1.25x" in note and "4: 1.11x" in note

    again = _model("llama")
    glu_cuda.attach(again, glu_cuda.mlx_gated, buckets=())
    timed = _timed(monkeypatch, {})
    assert glu_cuda.tune(again) == note and timed == []
    assert all(m._buckets == {1, 4} for m in glu_cuda.fused(again))


def test_a_machine_warming_up_while_it_is_timed_does_not_make_a_kernel_look_faster(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step timed 3% faster than the one before, the fused path no faster: timed
    without-with-with-without, no bucket takes it (timed without then with, each would
    have looked 3% faster)."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(glu_cuda.ENV, raising=False)
    model = _model("llama")
    glu_cuda.attach(model, glu_cuda.mlx_gated, buckets=())
    _timed(monkeypatch, {}, drift=0.03)
    assert "none faster" in glu_cuda.tune(model)
    assert all(not m._buckets for m in glu_cuda.fused(model))  # (the norm's fold may still take one stream)
    monkeypatch.setenv(glu_cuda.NORM_ENV, "0")
    assert glu_cuda.fold_norms(model) is None
    assert glu_cuda.fused(model) == []  # taken nowhere, no fold: the model's own MLPs again


def test_a_kernel_that_disagrees_is_never_taken(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path is checked against MLX's products and swiglu first: one that
    disagrees is not timed, and no bucket takes it."""
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(glu_cuda.ENV, raising=False)
    model = _model("qwen3")

    def wrong(mlp):
        gated = glu_cuda.mlx_gated(mlp)
        return lambda mlp, x, rows: gated(mlp, x, rows) * 1.1

    glu_cuda.attach(model, wrong, buckets=())
    timed = _timed(monkeypatch, {1: 0.5})
    assert "none faster" in glu_cuda.tune(model)
    assert timed == [] and all(not m._buckets for m in glu_cuda.fused(model))


def test_set_to_1_it_takes_every_bucket_untimed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.setenv(glu_cuda.ENV, "1")
    model = _model("qwen2")
    glu_cuda.attach(model, glu_cuda.mlx_gated, buckets=())
    timed = _timed(monkeypatch, {})
    assert "every step of 1-64 streams" in glu_cuda.tune(model)
    assert timed == [] and all(m._buckets == set(glu_cuda.BUCKETS) for m in glu_cuda.fused(model))


def test_a_load_where_the_kernel_cannot_run_keeps_the_model_as_it_was(tmp_path, monkeypatch) -> None:
    """The load's own order (``prepare_layers``) with the gated path allowed on a machine
    where its kernel cannot be built (this CPU): the check against MLX's products fails,
    no bucket takes it, and the model computes what it computed."""
    from gmlx.engine.kernels import prepare_layers

    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.delenv(glu_cuda.ENV, raising=False)
    monkeypatch.setattr(glu_cuda, "enabled", lambda: True)
    model = _model("llama")
    prompts = mx.array([[3, 1, 4, 1, 5, 9]])
    want = steps(model, make_prompt_cache(model), prompts)
    notes = prepare_layers(model)
    assert any("none faster" in n for n in notes)
    assert glu_cuda.fused(model) == []  # taken nowhere: the model's own MLPs again
    got = steps(model, make_prompt_cache(model), prompts)
    for a, b in zip(want, got, strict=True):
        assert mx.array_equal(a, b).item()


def test_a_tuning_that_fails_leaves_the_load_standing(tmp_path, monkeypatch, caplog) -> None:
    """Whatever goes wrong deciding where the gated kernel runs, the model loads without
    it (and the log says why)."""
    from gmlx.engine.kernels import prepare_layers

    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    monkeypatch.setattr(glu_cuda, "enabled", lambda: True)

    def broken(model):
        glu_cuda.use(model, glu_cuda.BUCKETS)
        raise OSError("no room for the tuning file")

    monkeypatch.setattr(glu_cuda, "tune", broken)
    model = _model("llama")
    with caplog.at_level("WARNING"):
        notes = prepare_layers(model)
    assert notes == [] and "glu_cuda is not used: no room" in caplog.text
    assert glu_cuda.fused(model) == []
