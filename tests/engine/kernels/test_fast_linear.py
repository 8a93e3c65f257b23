"""The CUDA-only quantized paths (``fast_linear``): never used where they are not built;
every quantized product's rows flattened; the tuner's choices confirmed on the whole
step and kept per machine. The kernel's own check against MLX's quantized matmul on the
CPU backend runs on a CUDA machine (``benchmarks/gpu/kernel_check.py``, and at every load
there); its lane arithmetic is replayed here in ``test_qmmw_cuda.py``. Where a test
stands in for CUDA (``available``) or for a clock (``_measure``, ``step_time``), it says
so; the products themselves run for real on the CPU."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from mlx import nn

from gmlx.engine.kernels import cuda_source, qmmw_cuda, timing
from gmlx.engine.kernels.fast_linear import FastQuantizedLinear, dequantized, use_fast_kernels
from gmlx.engine.kernels.timing import agrees, exact_product


def test_not_used_where_it_is_not_built() -> None:
    model = nn.Sequential(nn.Linear(256, 64))
    nn.quantize(model, group_size=64, bits=4)
    assert not cuda_source.available()  # this machine: MLX on the CPU (Metal is the same)
    assert use_fast_kernels(model) is None
    assert not any(isinstance(m, FastQuantizedLinear) for _, m in model.named_modules())


@pytest.mark.parametrize(("path", "bits", "group"), [("dense", 6, 32), ("exact", 4, 64)])
def test_the_reference_paths_are_the_same_product(path: str, bits: int, group: int) -> None:
    """The dequantize+dense path, and the float32 product every path is held to."""
    mx.random.seed(bits)
    wq, s, b = mx.quantize(mx.random.normal((64, 256)), group_size=group, bits=bits)
    x = mx.random.normal((3, 256))
    got = (dequantized if path == "dense" else exact_product)(x, wq, s, b, group, bits)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
    assert mx.allclose(got, want, atol=1e-3, rtol=1e-3)
    assert path == "dense" or got.dtype == mx.float32


def test_agreement_is_held_to_mlx_own_error() -> None:
    exact = mx.array([[100.0, -50.0, 3.0]])
    mlx_own = exact + mx.array([[0.2, 0.0, 0.0]])  # MLX's product is 0.2 off
    assert agrees(exact + mx.array([[0.0, 0.3, 0.0]]), mlx_own, exact)  # 0.3 <= 2 * 0.2 + 0.1
    assert not agrees(exact + mx.array([[0.0, 0.0, 1.0]]), mlx_own, exact)


def _tiny_quantized_llama() -> nn.Module:
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=128, num_key_value_heads=2)
    mx.random.seed(0)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    return model


@pytest.fixture(autouse=True)
def _own_tuning_file(tmp_path, monkeypatch) -> None:
    """Each test tunes afresh: the tuner's decisions are kept per machine on disk."""
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "cache"))


def test_a_bucket_stays_only_where_the_whole_step_got_faster(monkeypatch) -> None:
    """Per-layer choices are confirmed on the model's decode step: here the step is made
    (by a stand-in clock) faster with the one-row choices and slower with the two-row
    ones, so layers keep the first and lose the second; the products themselves run for
    real (the dense path runs on the CPU too)."""
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    x = mx.random.normal((2, 64))
    before = model.layers[0].self_attn.q_proj(x)
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: {
        1: (fast_linear.DENSE, (0, 0)), 2: (fast_linear.DENSE, (0, 0))})

    def step_time(model: nn.Module, rows: int) -> float:
        fast = any(rows in getattr(m, "paths", {}) for _, m in model.named_modules())
        return {(1, True): 0.5, (1, False): 1.0, (2, True): 1.0, (2, False): 1.0}[(rows, fast)]

    monkeypatch.setattr(timing, "step_time", step_time)
    note = use_fast_kernels(model)
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    swapped = [m for m in layers if isinstance(m, FastQuantizedLinear)]
    assert swapped and all(m.paths == {1: (fast_linear.DENSE, (0, 0))} for m in swapped)
    assert note is not None and "1: 2.00x" in note
    after = model.layers[0].self_attn.q_proj(x[:1])  # one row: the dense path
    assert mx.allclose(after, before[:1], atol=1e-4, rtol=1e-4)


def test_nothing_is_kept_when_no_step_gets_faster(monkeypatch) -> None:
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: {1: (fast_linear.DENSE, (0, 0))})
    monkeypatch.setattr(timing, "step_time", lambda model, rows: 1.0)
    note = use_fast_kernels(model)
    assert note is not None and "none faster" in note
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all(isinstance(m, FastQuantizedLinear) and m.paths == {} for m in layers)
    # the decisions are not part of the model's parameter tree
    from mlx.utils import tree_flatten

    assert not any("paths" in key for key, _ in tree_flatten(model.parameters()))
    assert all("paths" not in m for m in layers)


def _spy_on_quantized_matmul(monkeypatch) -> list[int]:
    """The number of dimensions of every input MLX's quantized matmul is given."""
    seen: list[int] = []
    real = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(x.ndim)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return seen


def test_every_quantized_product_gets_its_rows_flattened(monkeypatch) -> None:
    """A decode step's (streams, 1, K) input reaches MLX's quantized matmul as
    (streams, K) (for which MLX reads each weight once, not once per stream), with the
    same result; ``GMLX_QMV_KERNEL=flat`` does only that, timing nothing."""
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    tokens = mx.array([[3], [5], [7], [11]])
    before = model(tokens)
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setenv("GMLX_QMV_KERNEL", "flat")
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: pytest.fail("timed in flat mode"))
    quantized = sum(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
                    for _, m in model.named_modules())
    note = use_fast_kernels(model)
    assert note == f"cuda: {quantized} quantized layer(s) take their input as (rows, K)"
    seen = _spy_on_quantized_matmul(monkeypatch)
    after = model(tokens)
    assert seen and set(seen) == {2}
    assert mx.allclose(after, before, atol=1e-5, rtol=1e-5)
    seen.clear()  # one sequence (a prompt, or one stream): already rows to MLX, left alone
    model(mx.array([[3, 5, 7]]))
    assert seen and set(seen) == {3}


def test_a_tied_output_layer_is_flattened_too(monkeypatch) -> None:
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=128, num_key_value_heads=2, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[3], [5]])
    before = model(tokens)
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setenv("GMLX_QMV_KERNEL", "flat")
    use_fast_kernels(model)
    assert isinstance(model.model.embed_tokens, fast_linear_module().FlatQuantizedEmbedding)
    seen = _spy_on_quantized_matmul(monkeypatch)
    assert mx.allclose(model(tokens), before, atol=1e-5, rtol=1e-5)
    assert set(seen) == {2} and len(seen) == 8  # 7 layers and the tied output


def fast_linear_module():
    from gmlx.engine.kernels import fast_linear

    return fast_linear


def test_off_means_untouched(monkeypatch) -> None:
    model = _tiny_quantized_llama()
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setenv("GMLX_QMV_KERNEL", "0")
    assert use_fast_kernels(model) is None
    assert all(type(m) is not FastQuantizedLinear for _, m in model.named_modules())


def test_a_second_load_reuses_the_decisions(monkeypatch) -> None:
    """The tuner's decisions are kept per machine: a second model of the same shapes
    measures nothing and times no step, and takes the same paths."""
    from gmlx import paths
    from gmlx.engine.kernels import fast_linear

    calls = {"measure": 0, "step": 0}

    def measure(layer: nn.Module, *_: object) -> dict:
        calls["measure"] += 1
        return {1: (fast_linear.DENSE, (0, 0))}

    def step_time(model: nn.Module, rows: int) -> float:
        calls["step"] += 1
        return 0.5 if any(rows in getattr(m, "paths", {}) for _, m in model.named_modules()) else 1.0

    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", measure)
    monkeypatch.setattr(timing, "step_time", step_time)
    first = use_fast_kernels(_tiny_quantized_llama())
    assert calls["measure"] > 0 and calls["step"] == 4  # with and without, twice each
    assert (paths.cache_dir() / "kernels" / "tuning.json").is_file()
    calls.update(measure=0, step=0)
    model = _tiny_quantized_llama()
    again = use_fast_kernels(model)
    assert first is not None and again is not None and calls == {"measure": 0, "step": 0}
    assert again.rsplit(" (", 1)[0] == first.rsplit(" (", 1)[0]  # the same, but for the time
    swapped = [m for _, m in model.named_modules() if isinstance(m, FastQuantizedLinear)]
    assert swapped and all(m.paths == {1: (fast_linear.DENSE, (0, 0))} for m in swapped)


def test_a_damaged_tuning_file_is_tuned_again(monkeypatch) -> None:
    from gmlx import paths
    from gmlx.engine.kernels import fast_linear, tuning

    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: {1: (fast_linear.DENSE, (0, 0))})
    monkeypatch.setattr(timing, "step_time", lambda model, rows: 1.0)
    file = paths.cache_dir() / "kernels" / "tuning.json"
    file.parent.mkdir(parents=True)
    file.write_text("{not json")
    assert "none faster" in (use_fast_kernels(_tiny_quantized_llama()) or "")
    assert file.read_text().startswith("{") and f'"format": {tuning.FORMAT}' in file.read_text()


def test_a_tuning_is_taken_only_on_the_card_it_was_made_on(monkeypatch) -> None:
    """Two cards of one architecture (an H100 and an H200 are both sm_90) choose apart:
    what one kept on disk is not taken on the other, and is taken on its own again."""
    from gmlx.engine.kernels import tuning

    card = {"architecture": "sm_90", "device_name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(mx, "device_info", lambda: dict(card))
    made = tuning.Tuning()
    made.set_layer("k", {1: ("gemv", (4, 2))})
    made.save()
    card["device_name"] = "NVIDIA H200"
    assert tuning.Tuning().layer("k") is None
    card["device_name"] = "NVIDIA H100 80GB HBM3"
    assert tuning.Tuning().layer("k") == {1: ("gemv", (4, 2))}
    del card["device_name"]  # a backend that names no device: its architecture alone
    assert tuning.machine() == f"mlx-{mx.__version__}/sm_90"


def test_the_step_timer_runs_real_decode_steps_each_fed_the_last_ones_tokens() -> None:
    """As the worker runs them: one prompt, then one-token steps (two untimed), each fed
    the greedy pick of the step before, never the same zeros again."""
    from gmlx.engine.kernels.timing import step_time

    model = _tiny_quantized_llama()
    seen: list[tuple[tuple[int, ...], mx.array, mx.array]] = []  # (input shape, input, greedy pick)

    class Recording:
        layers = model.layers  # what mlx-lm's cache maker reads

        def __call__(self, tokens, cache=None):
            out = model(tokens, cache=cache)
            seen.append((tokens.shape, tokens, mx.argmax(out[:, -1, :], axis=-1)))
            return out

    assert step_time(Recording(), 2, context=4, steps=3) > 0
    assert [shape for shape, _, _ in seen] == [(2, 4)] + [(2, 1)] * 6
    for (_, _, picked), (_, fed, _) in itertools.pairwise(seen[1:]):
        assert fed.reshape(-1).tolist() == picked.tolist()


def test_the_dense_prefill_path_is_priced_as_scratch(monkeypatch) -> None:
    """Layers whose prefill-sized products dequantize (the ``LARGE`` bucket's dense
    path) hold that float weight while the product runs: the capacity model adds the
    largest one to every prefill's transient. (A stand-in for CUDA and the clocks, as
    above; the geometry is measured for real.)"""
    from dataclasses import replace

    from gmlx.engine import capacity
    from gmlx.engine.kernels import fast_linear
    from gmlx.engine.loading import load_model

    loaded = load_model("demo")
    nn.quantize(loaded.model, group_size=32, bits=4)
    before = capacity.probe_geometry(loaded)
    assert before.dense_scratch_bytes == 0
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: {
        fast_linear.LARGE: (fast_linear.DENSE, (0, 0))})
    monkeypatch.setattr(timing, "step_time", lambda model, rows: 0.5 if any(
        rows in getattr(m, "paths", {}) for _, m in model.named_modules()) else 1.0)
    use_fast_kernels(loaded.model)
    dense = [m for _, m in loaded.model.named_modules()
             if isinstance(m, FastQuantizedLinear) and fast_linear.LARGE in m.paths]
    assert dense
    largest = max(m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * m.scales.dtype.size for m in dense)
    after = capacity.probe_geometry(loaded)
    assert after.dense_scratch_bytes == largest
    assert (capacity.prefill_transient(after, 512, 512)
            == capacity.prefill_transient(replace(after, dense_scratch_bytes=0), 512, 512) + largest)


@pytest.mark.parametrize(("rows", "want"), [(1, 1), (3, 4), (33, 64), (64, 64), (65, 128), (128, 128),
                                            (129, 256), (256, 256), (257, 512), (2048, 512)])
def test_each_product_takes_the_bucket_measured_near_its_rows(rows: int, want: int) -> None:
    """A short prompt's prefill has its own buckets: the dense path's cost does not
    shrink with the rows, so its speed at a 512-row chunk says nothing about 65 rows."""
    from gmlx.engine.kernels import fast_linear

    assert fast_linear.bucket(rows) == want
    assert want in fast_linear.BUCKETS


def test_each_chosen_path_is_bound_once_per_layer(monkeypatch) -> None:
    """A layer binds each (path, launch shape) it was given once, on first use, and every
    product of a row bucket takes its path; a bucket with no path is MLX's product. (The
    kernels' ``bound`` stand in, answering with MLX's product: CUDA cannot run here.)"""
    from gmlx.engine.kernels import fast_linear, qgemv_cuda

    bound: list[tuple[str, tuple[int, ...]]] = []

    def binder(name: str):
        def bind(w, scales, biases, group_size, bits, config):
            bound.append((name, config))
            return lambda x: mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                                 group_size=group_size, bits=bits)
        return bind

    monkeypatch.setattr(qgemv_cuda, "bound", binder("gemv"))
    monkeypatch.setattr(qmmw_cuda, "bound", binder("kernel"))
    layer = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    x = mx.random.normal((12, 1, 64))
    want = layer(x)
    layer.__class__ = FastQuantizedLinear
    layer.set_paths({1: (fast_linear.GEMV, (4, 2)), 8: (fast_linear.KERNEL, (1, 4, 4))})
    for rows in (1, 1, 5, 8, 12, 1):
        assert mx.allclose(layer(x[:rows]), want[:rows], atol=1e-5, rtol=1e-5)  # the bias added too
    assert bound == [("gemv", (4, 2)), ("kernel", (1, 4, 4))]  # 12 rows: bucket 16, MLX's own


def test_a_decode_shape_works_out_its_call_once_and_a_prefill_shape_every_time(monkeypatch) -> None:
    """Every layer of every decode step comes through ``__call__``: a decode step's input
    (one token a stream, at most ``MAX_KEPT_ROWS`` streams) keeps its worked-out call per
    shape; a prompt's rows vary with every prompt and are worked out each time, so
    nothing piles up."""
    from gmlx.engine.kernels import fast_linear

    worked_out: list[tuple[int, ...]] = []
    real = FastQuantizedLinear._call_for

    def spy(self, x):
        worked_out.append(tuple(x.shape))
        return real(self, x)

    monkeypatch.setattr(FastQuantizedLinear, "_call_for", spy)
    layer = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    decode, prefill = mx.random.normal((3, 1, 64)), mx.random.normal((1, 5, 64))  # a short prompt's chunk
    want = layer(decode), layer(prefill)
    layer.__class__ = FastQuantizedLinear
    layer.set_paths({4: (fast_linear.DENSE, (0, 0))})
    for _ in range(3):
        assert mx.allclose(layer(decode), want[0], atol=1e-4, rtol=1e-4)  # the dense path, bias added
        assert mx.allclose(layer(prefill), want[1], atol=1e-4, rtol=1e-4)  # MLX's, rows flattened
    assert worked_out == [(3, 1, 64), *[(1, 5, 64)] * 3]
    assert list(layer.by_shape) == [((3, 1, 64), decode.dtype)]


def test_the_confirming_steps_run_the_paths_they_time(monkeypatch) -> None:
    """The whole-step check times each bucket without its paths, then with them, on the
    same shapes: the calls the layers worked out for the first run must not stand in for
    the second. The stand-in clock says a step is faster when the dense path really ran
    in it; the step itself is the model's, for real."""
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: {2: (fast_linear.DENSE, (0, 0))})
    ran_dense: list[bool] = []
    real_dense = fast_linear.dequantized

    def dense(*args):
        ran_dense.append(True)
        return real_dense(*args)

    monkeypatch.setattr(fast_linear, "dequantized", dense)

    def step_time(model: nn.Module, rows: int) -> float:
        ran_dense.clear()
        for _ in range(2):  # the same shapes twice, as the real timer's steps are
            mx.eval(model(mx.zeros((rows, 1), mx.int32)))
        return 0.5 if ran_dense else 1.0

    monkeypatch.setattr(timing, "step_time", step_time)
    note = use_fast_kernels(model)
    assert note is not None and "2: 2.00x" in note
    swapped = [m for _, m in model.named_modules() if isinstance(m, FastQuantizedLinear)]
    assert swapped and all(m.paths == {2: (fast_linear.DENSE, (0, 0))} for m in swapped)


@pytest.mark.parametrize("mode", ["queue", "chain"])
def test_mlx_product_is_timed_first_and_last_so_a_warming_machine_does_not_lose_it(monkeypatch, mode: str) -> None:
    """Each row bucket times MLX's product, then every path that agrees with it, then
    MLX's again, keeping its faster time: on a machine speeding up while it is timed
    (the stand-in clock: each timing 5% faster than the last) the dense path, no faster
    in truth, must not win for having been timed second, nor for the runoff between close
    ones (:func:`timing.runoff`: MLX's timed last again). The products run for real,
    queued (the default) or in a chain (``GMLX_PRODUCT_TIMING=chain``)."""
    from gmlx.engine.kernels import fast_linear

    monkeypatch.setenv("GMLX_PRODUCT_TIMING", mode)
    layer = _tiny_quantized_llama().layers[0].self_attn.q_proj
    order: list[int] = []

    def warming(call, *rest) -> float:
        mx.eval(call(rest[0]) if mode == "chain" else call())
        order.append(len(order))
        return 0.95 ** order[-1]

    monkeypatch.setattr(timing, f"{mode}_time", warming)
    assert fast_linear._measure(layer) == {}  # MLX's product everywhere
    # on this CPU: MLX, dense, MLX again (each a call's slope where decode-sized: the clock's warming makes
    # those far apart); where one run times each, the two are close (5%) and timed again forward then back
    runs = [2 * timing.ROUNDS * 3 if rows <= fast_linear.SLOPED_ROWS else 3 + 2 * timing.RUNOFF_ROUNDS
            for rows in fast_linear.BUCKETS]
    assert len(order) == sum(runs)


@pytest.mark.parametrize("mode", ["queue", "chain"])
def test_a_products_timing_passes_through_the_weights_of_layers_alike(monkeypatch, mode: str) -> None:
    """One layer's product repeated finds its weights in the GPU's L2 cache, where a
    step reads each layer from memory: each timing goes through the weights of the
    layers of the same shape in turn, as many as ``COLD_BYTES`` takes (here three of
    four), and checks agreement on the layer's own. The products run for real."""
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    first = model.layers[0].self_attn.q_proj
    layers = [first] + [m for _, m in model.named_modules() if m is not first and
                         isinstance(m, nn.QuantizedLinear) and fast_linear._key(m) == fast_linear._key(first)]
    assert len(layers) >= 4
    size = sum(a.nbytes for a in (layers[0].weight, layers[0].scales, layers[0].biases))
    monkeypatch.setattr(fast_linear, "COLD_BYTES", 3 * size)
    read: list[int] = []
    real = mx.quantized_matmul

    def recording(x, w, *rest, **kw):
        read.append(next(i for i, m in enumerate(layers) if m.weight is w))
        return real(x, w, *rest, **kw)

    def chain_clock(call, x, reps: int) -> float:
        del read[:]
        for _ in range(reps):
            x = call(x)  # each product's input the last one's output
        mx.eval(x)
        timed.append(list(read))
        return 1.0

    def queue_clock(call, reps: int) -> float:
        del read[:]
        mx.eval([call() for _ in range(reps)])
        timed.append(list(read))
        return 1.0

    timed: list[list[int]] = []
    monkeypatch.setattr(mx, "quantized_matmul", recording)
    monkeypatch.setenv("GMLX_PRODUCT_TIMING", mode)
    monkeypatch.setattr(timing, f"{mode}_time", chain_clock if mode == "chain" else queue_clock)
    fast_linear._measure(layers[0], layers[1:], reps=4)
    mlx_timings = [t for t in timed if t]  # on this CPU: MLX's runs (the dense path's read no matmul of MLX's)
    assert {len(t) for t in mlx_timings} == {4, 4 * timing.LONGER}  # a short and a long run where decode-sized
    assert all(t == [i % 3 for i in range(len(t))] for t in mlx_timings)


def test_steps_with_compiled_blocks_are_decided_apart(monkeypatch) -> None:
    """A whole step's timing depends on whether its blocks run compiled (a kernel's host
    cost is paid at a trace then, not every step), so the decision is kept under a key of
    its own: a load with the blocks compiled does not take one made without them (here a
    stand-in clock makes the one-row paths faster only with the blocks compiled); blocks
    traced before trace again after, with the paths chosen."""
    from gmlx.engine.kernels import compiled_blocks, fast_linear, one_token
    from gmlx.engine.prompt_cache import batch_cache

    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: {1: (fast_linear.DENSE, (0, 0))})

    def step_time(model: nn.Module, rows: int) -> float:
        fast = any(rows in getattr(m, "paths", {}) for _, m in model.named_modules())
        return 0.5 if fast and compiled_blocks.attached(model) else 1.0

    monkeypatch.setattr(timing, "step_time", step_time)
    plain = _tiny_quantized_llama()
    assert "none faster" in (use_fast_kernels(plain) or "")
    compiled = _tiny_quantized_llama()
    one_token.attach(compiled)
    assert compiled_blocks.attach(compiled) == 2
    cache = batch_cache(compiled, 1)
    mx.eval(compiled(mx.array([[1, 2]]), cache=cache), compiled(mx.array([[3]]), cache=cache))
    assert all(block._pieces is not None for block in compiled.layers)  # traced, MLX's products in them
    assert "1: 2.00x" in (use_fast_kernels(compiled) or "")
    assert all(block._pieces is None for block in compiled.layers)  # they trace the chosen paths next
    again = _tiny_quantized_llama()
    assert "none faster" in (use_fast_kernels(again) or "")  # each kept apart, on disk


@pytest.mark.parametrize("n", [8, 24, 3])
def test_a_chained_product_feeds_its_output_to_the_next_call(n: int) -> None:
    """``timing.chained`` makes each product's output the next call's input, shaped as
    the input (its first elements, repeated where the output is shorter), cycling
    through the weights; ``chain_time`` runs its calls one after another from ``x``."""
    k = 8
    weights = [(mx.full((n, k), float(i + 1)),) for i in range(2)]
    calls: list[float] = []

    def product(x, w):
        calls.append(w[0, 0].item())
        return x @ w.T

    call = timing.chained(product, weights)
    x = mx.arange(2 * k, dtype=mx.float32).reshape(2, k) / 100
    y = call(x)
    full = (x @ weights[0][0].T).reshape(-1)
    want = mx.concatenate([full] * -(-x.size // full.size))[:x.size].reshape(x.shape)
    assert y.shape == x.shape and mx.array_equal(y, want)
    z = call(y)  # the second weights
    assert z.shape == x.shape and mx.array_equal(z[0, :min(n, k)], (y @ weights[1][0].T)[0, :min(n, k)])
    calls.clear()
    seconds = timing.chain_time(timing.chained(product, weights), x, 4)
    assert seconds >= 0 and calls == [1.0, 2.0, 1.0] + [2.0, 1.0, 2.0, 1.0]  # three to warm up, then the chain


def test_a_residual_is_added_in_the_one_row_kernel_where_the_layer_takes_it(monkeypatch) -> None:
    """``plus(layer, x, r)`` is ``r + layer(x)``: in one launch of the one-row kernel with
    the residual (``bound(..., residual=True)``) where the rows' bucket takes that path and
    the layer has no bias; else, and with ``GMLX_RESIDUAL_KERNEL=0``, the product and
    MLX's add. (``bound`` stands in, answering with MLX's product plus the residual: CUDA
    cannot run here; the kernel's own source is checked in test_qgemv_cuda.)"""
    from gmlx.engine.kernels import fast_linear, qgemv_cuda

    bound: list[tuple] = []

    def bind(w, scales, biases, group_size, bits, config, residual=False):
        bound.append((config, residual))

        def run(x, *r):
            y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
            return r[0] + y if residual else y
        return run

    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    layer = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    x = mx.random.normal((3, 1, 64))
    r = mx.random.normal((3, 1, 32))
    want = r + layer(x)
    assert mx.array_equal(fast_linear.plus(layer, x, r), want).item()  # not a fast layer: the model's add
    layer.__class__ = FastQuantizedLinear
    layer.set_paths({1: (fast_linear.GEMV, (4, 2)), 4: (fast_linear.KERNEL, (1, 8, 2))})
    monkeypatch.setattr(qmmw_cuda, "bound", lambda w, s, b, g, bits, config: lambda x: mx.quantized_matmul(
        x, w, s, b, transpose=True, group_size=g, bits=bits))
    assert mx.allclose(fast_linear.plus(layer, x[:1], r[:1]), want[:1], atol=1e-5).item()
    assert bound == [((4, 2), True)]  # one launch, the residual in it
    assert mx.allclose(fast_linear.plus(layer, x, r), want, atol=1e-5).item()  # 3 rows: the tensor-core path
    assert bound == [((4, 2), True)]  # not the residual's kernel
    assert mx.allclose(fast_linear.plus(layer, x[:1], r[0]), want[:1], atol=1e-5).item()  # a broadcast residual
    assert bound == [((4, 2), True), ((4, 2), False)]  # the plain kernel, then MLX's add
    monkeypatch.setenv("GMLX_RESIDUAL_KERNEL", "0")
    layer.set_paths({1: (fast_linear.GEMV, (4, 2))})
    assert mx.allclose(fast_linear.plus(layer, x[:1], r[:1]), want[:1], atol=1e-5).item()
    assert bound[2:] == [((4, 2), False)]


@pytest.mark.parametrize("right", [True, False])
def test_the_load_checks_the_residual_kernel_against_mlx_add(monkeypatch, caplog, right: bool) -> None:
    """At the load, each layer shape whose paths take the one-row kernel runs it with a
    residual against the same product plus MLX's add, at each such bucket: the same bits
    or no layer of that shape adds its residual in the kernel again (a warning). (The
    kernel's ``bound`` stands in: CUDA cannot run here.)"""
    import logging

    from gmlx.engine.kernels import fast_linear, qgemv_cuda

    def bind(w, scales, biases, group_size, bits, config, residual=False):
        def run(x, *r):
            y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
            return (r[0] + y if right else r[0] + y + 1) if residual else y
        return run

    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    layers = [nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4) for _ in range(2)]
    for layer in layers:
        layer.__class__ = FastQuantizedLinear
        layer.set_paths({1: (fast_linear.GEMV, (4, 2)), 2: (fast_linear.GEMV, (4, 2, 2))})
    key = fast_linear._key(layers[0])
    with caplog.at_level(logging.WARNING, logger=fast_linear.__name__):
        fast_linear._check_residuals({key: layers}, {key: dict(layers[0].paths)})
    assert all(getattr(layer, "residual_ok", True) == right for layer in layers)
    assert ("add their residuals after the product" in caplog.text) != right
    x, r = mx.random.normal((1, 1, 64)), mx.random.normal((1, 1, 32))
    assert mx.allclose(layers[1].plus(x, r), r + layers[1](x), atol=1e-5).item()  # right either way


def test_the_split_shapes_tuning_is_kept_apart(monkeypatch) -> None:
    """With the split shapes (``GMLX_SPLIT_K``, on by default) the products' tuner times
    them too, so its choices are kept under keys of their own: a load with them measures
    again after one without (``GMLX_SPLIT_K=0``), and a second load with them measures
    nothing."""
    from gmlx.engine.kernels import fast_linear, qgemv_cuda

    measured = []
    monkeypatch.setattr(cuda_source, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer, *_: measured.append(1) or {1: (fast_linear.DENSE, (0, 0))})
    monkeypatch.setattr(timing, "step_time", lambda model, rows: 1.0)
    monkeypatch.setenv(qgemv_cuda.SPLIT_ENV, "0")
    use_fast_kernels(_tiny_quantized_llama())
    assert measured
    measured.clear()
    monkeypatch.delenv(qgemv_cuda.SPLIT_ENV)  # the default
    use_fast_kernels(_tiny_quantized_llama())
    assert measured
    measured.clear()
    use_fast_kernels(_tiny_quantized_llama())
    assert not measured
