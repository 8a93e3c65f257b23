"""One-token steps of llama-pattern blocks in two compiled pieces (``compiled_blocks``):
the same logits bit for bit as the blocks uncompiled on padded batch caches (float and
quantized weights, float32 and bfloat16), the same tokens through mlx-lm's generator and
gmlx's worker, prompt steps and single-sequence caches left to the model's own code, one
trace per decode width. Real MLX on the CPU; tiny mlx-lm models."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from gmlx.engine.kernels import compiled_blocks, one_token
from tests.engine.decoding import decode_together
from tests.engine.kernels.models import one_row_kernels, steps, tiny

LAYERS = 3
PADDED = mx.array([[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0, 7, 7, 8, 8, 9], [0, 0, 0, 0, 0, 2, 4, 6]])


def _padded() -> list[BatchKVCache]:
    return [BatchKVCache([0, 3, 5]) for _ in range(LAYERS)]


def _prepared(family: str, quantized: bool = False, dtype=None) -> nn.Module:
    model = tiny(family, LAYERS, quantized=quantized, dtype=dtype)
    assert one_token.attach(model) == LAYERS
    return model


@pytest.mark.parametrize("family", compiled_blocks.FAMILIES)
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("dtype", [None, mx.bfloat16])
def test_the_same_logits_bit_for_bit(family: str, quantized: bool, dtype) -> None:
    model = _prepared(family, quantized, dtype)
    want = steps(model, _padded(), PADDED, n=5)
    assert compiled_blocks.attach(model) == LAYERS
    got = steps(model, _padded(), PADDED, n=5)
    assert all(block._pieces is not None for block in model.layers)  # the compiled path ran
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert mx.array_equal(a, b).item(), f"{family}: step {step} differs"


def test_prompt_steps_and_single_sequence_caches_run_the_models_own_code() -> None:
    model = _prepared("llama")
    compiled_blocks.attach(model)
    steps(model, [KVCache() for _ in range(LAYERS)], PADDED[:1])  # a plain cache's offset is a number
    assert all(block._pieces is None for block in model.layers)


def test_one_trace_per_decode_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece is traced once per width, not once per step (the cache's length grows)."""
    model = _prepared("llama")
    compiled_blocks.attach(model)
    traced: list[tuple[int, ...]] = []
    queries_keys_values = one_token.queries_keys_values

    def counting(attention, x, offset):
        traced.append(x.shape)
        return queries_keys_values(attention, x, offset)

    monkeypatch.setattr(one_token, "queries_keys_values", counting)
    steps(model, _padded(), PADDED, n=6)
    steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PADDED[:1], n=6)
    assert sorted(traced) == [(1, 1, 128)] * LAYERS + [(3, 1, 128)] * LAYERS


def test_detach_and_what_is_left_alone() -> None:
    from mlx_lm.models import gemma3_text, llama

    model = _prepared("llama")
    assert compiled_blocks.attach(model) == LAYERS
    compiled_blocks.detach(model)
    assert {type(block) for block in model.layers} == {llama.TransformerBlock}
    plain = tiny("llama", LAYERS)  # no one-token attention: its blocks are left as they are
    assert compiled_blocks.attach(plain) == 0
    gemma = tiny("gemma3_text", LAYERS)  # not the pattern (norms around each half)
    one_token.attach(gemma)
    assert compiled_blocks.attach(gemma) == 0
    assert {type(block) for block in gemma.layers} == {gemma3_text.TransformerBlock}


@pytest.mark.parametrize("family", compiled_blocks.FAMILIES)
def test_the_same_tokens_through_mlx_lm_generator(family: str) -> None:
    model = _prepared(family, quantized=True)
    want = decode_together(model, 10_000)
    compiled_blocks.attach(model)
    assert decode_together(model, 10_000) == want


def test_the_same_tokens_through_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's load with ``GMLX_COMPILE_BLOCKS=1``: the worker's greedy streams, joined
    at different steps, give the tokens they give without it."""
    from gmlx.engine.kernels import prepare_layers
    from gmlx.engine.loading import load_model
    from gmlx.engine.types import GenerateRequest, SamplingParams
    from gmlx.engine.worker import ModelWorker

    def tokens(compiled: bool) -> list[list[int]]:
        monkeypatch.setenv(compiled_blocks.ENV, "1" if compiled else "0")
        loaded = load_model("demo")
        model = tiny("qwen2", LAYERS, quantized=True)
        prepare_layers(model)
        assert all(vars(type(block)).get("compiled_block") for block in model.layers) == compiled
        loaded = replace(loaded, model=model, config={**loaded.config, "vocab_size": 256})
        worker = ModelWorker(loaded, decode_batch=4, prompt_cache_bytes=0)
        try:
            greedy = SamplingParams(temperature=0.0, logit_bias={t: -100.0 for t in (0, 1, 2)})
            handles = [worker.submit(GenerateRequest(tuple(range(3 + i, 9 + 2 * i)), max_tokens=12 + i,
                                                     sampling=greedy)) for i in range(3)]
            out = [[t for ev in handle for t in (ev.token_ids or ())] for handle in handles]
            assert all((getattr(block, "_pieces", None) is not None) == compiled for block in model.layers)
            return out
        finally:
            worker.close()

    want = tokens(False)
    assert [len(t) for t in want] == [12, 13, 14]
    assert tokens(True) == want


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_blocks_with_the_fused_add_and_norm_compile_too(family: str) -> None:
    """Blocks ``add_norm_cuda`` fused (MLX's own add and norm standing in for its CUDA
    kernel) compile as well: the same logits bit for bit, each block past the first taking
    the last one's output as its two parts inside its first piece, the fused add and
    norm called at the traces only (once in the first block, twice in each other), and
    by the final norm at every step."""
    from gmlx.engine.kernels import add_norm_cuda

    model = tiny(family, LAYERS, dtype=mx.bfloat16, seed=7)  # the kernel's activations
    one_token.attach(model)
    want = steps(model, _padded(), PADDED, n=5)
    calls: list[tuple[int, ...]] = []

    def fused(x, r, w, eps):
        calls.append(tuple(x.shape))
        return add_norm_cuda.mlx_add_norm(x, r, w, eps)

    assert add_norm_cuda.attach(model, fused) == LAYERS
    assert compiled_blocks.attach(model) == LAYERS
    got = steps(model, _padded(), PADDED, n=5)
    assert all(block._pieces is not None for block in model.layers)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert mx.array_equal(a, b).item(), f"{family}: step {step} differs"
    assert calls.count((3, 1, 128)) == (2 * LAYERS - 1) + 5
    compiled_blocks.detach(model)
    assert all(vars(type(block)).get("add_norm") for block in model.layers)  # the fused blocks again


def test_the_tuners_time_the_compiled_blocks_and_trace_them_again_after_each_switch() -> None:
    """A load's tuners time whole steps as they are served: over the worker's batch cache,
    through the compiled pieces (the MLP runs in Python once a timing, at its trace, not
    at each of its 15 one-token steps); a trace keeps what it met, so every switch of
    ``use`` traces again, and the blocks end traced with what ``use(True)`` left."""
    from gmlx.engine.kernels import timing

    model = _prepared("llama", quantized=True)
    assert compiled_blocks.attach(model) == LAYERS
    scale = {"now": 1.0}
    traced: list[float] = []  # the scale each one-token MLP call met

    class Scaled(type(model.layers[0].mlp)):
        def __call__(self, x: mx.array) -> mx.array:
            if x.shape[1] == 1:
                traced.append(scale["now"])
            return super().__call__(x) * scale["now"]

    for block in model.layers:
        block.mlp.__class__ = Scaled

    def use(taken: bool) -> None:
        scale["now"] = 2.0 if taken else 1.0

    without, with_scaled = timing.step_times(model, 2, use)
    assert without > 0 and with_scaled > 0
    assert traced == [s for s in (1.0, 2.0, 2.0, 1.0) for _ in range(LAYERS)]
    assert all(block._pieces is None for block in model.layers)  # the next step traces use(True)'s


def test_on_by_default_on_the_cpu_and_cuda_off_on_metal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compiled_blocks.ENV, raising=False)
    assert compiled_blocks.enabled()  # this suite runs on MLX's CPU backend
    monkeypatch.setenv(compiled_blocks.ENV, "0")
    assert not compiled_blocks.enabled()
    monkeypatch.setattr("gmlx.engine.capacity.backend", lambda: "cuda")
    assert not compiled_blocks.enabled()  # 0 turns it off there too
    monkeypatch.delenv(compiled_blocks.ENV)
    assert compiled_blocks.enabled()  # measured faster on the H200
    monkeypatch.setattr("gmlx.engine.capacity.backend", lambda: "metal")
    assert not compiled_blocks.enabled()  # not until measured there
    monkeypatch.setenv(compiled_blocks.ENV, "1")
    assert compiled_blocks.enabled()


def test_a_blocks_residual_adds_ride_in_its_one_row_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the attention's output projection and the MLP's down projection take the
    one-row kernel (their path at one row) and the MLP its gated product, a compiled
    block adds its input, and then the attention's sum, in those two products' launches
    (``fast_linear.plus``, ``glu_cuda.plus``): the same logits bit for bit as the model's
    own code, two residual launches a layer. (``qgemv_cuda.bound`` stands in with MLX's
    product, plus the residual where asked: CUDA cannot run here; the kernel's own
    source is checked in test_qgemv_cuda.)"""
    from gmlx.engine.kernels import glu_cuda, qgemv_cuda

    residuals: list[tuple[int, ...]] = []

    def bind(w, scales, biases, group_size, bits, config, residual=False):
        def run(x, *r):
            y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
            if residual:
                residuals.append(w.shape)
            return r[0] + y if residual else y
        return run

    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    model = _prepared("llama", quantized=True, dtype=mx.bfloat16)
    want = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PADDED[:1], n=3)
    one_row_kernels(model)
    assert glu_cuda.attach(model, glu_cuda.mlx_gated) == LAYERS
    assert compiled_blocks.attach(model) == LAYERS
    got = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PADDED[:1], n=3)
    assert all(block._pieces is not None for block in model.layers)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    layer = model.layers[0]
    # each traced once at one stream: the output projection's and the down projection's, a layer each
    assert sorted(residuals) == sorted([layer.self_attn.o_proj.weight.shape, layer.mlp.down_proj.weight.shape] * LAYERS)
    glu_cuda.detach(model)
    compiled_blocks.detach(model)


def _per_head(x, heads, outs: list) -> tuple:
    """``outs`` in the shapes the kernels write for ``heads`` (one token a stream: per head)."""
    from gmlx.engine.kernels import cuda_source

    shapes = cuda_source.out_shapes(x.shape[:-1], [o.shape[-1] for o in outs], heads)
    return tuple(o.reshape(shape) for o, shape in zip(outs, shapes, strict=True))


def _folding_bind(folded: list[tuple[int, ...]], disagree: bool = False):
    """``qgemv_cuda.bound`` standing in with MLX's norm, products and swiglu (CUDA cannot
    run here); ``disagree``: the norm's scale left out."""
    from mlx_lm.models.activations import swiglu

    def bind(w, scales, biases, group_size, bits, config, up=None, residual=False, norm=None, stacked=None):
        def product(x, layer):
            return mx.quantized_matmul(x, *layer, transpose=True, group_size=group_size, bits=bits)

        def run(x, *r):
            if norm is not None:
                folded.append(x.shape)
                n = x * norm[0] if disagree else mx.fast.rms_norm(x, norm[0], norm[1])
                return swiglu(product(n, (w, scales, biases)), product(n, up))
            y = product(x, (w, scales, biases))
            return r[0] + y if residual else y
        return run
    return bind


def test_the_norm_before_the_mlp_rides_in_its_gated_product_at_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a block's MLP takes its gated product at one stream on the CUDA-core source,
    the load gives it that kernel with the block's RMSNorm folded in (``fold_norms``,
    checked against MLX's norm, products and swiglu) and the compiled block hands it the
    hidden state itself: one launch a layer fewer, the same logits bit for bit where the
    kernel computes what MLX does (``qgemv_cuda.bound`` stands in with MLX's norm,
    products and swiglu: CUDA cannot run here; the kernel's own source is checked against
    them in test_qgemv_cuda). Two streams keep the norm; GMLX_NORM_FOLD=0 folds none."""
    from gmlx.engine.kernels import glu_cuda, qgemv_cuda

    folded: list[tuple[int, ...]] = []
    bind = _folding_bind(folded)
    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    model = _prepared("llama", quantized=True, dtype=mx.bfloat16)
    want = [steps(model, [BatchKVCache([0] * rows) for _ in range(LAYERS)], PADDED[:rows], n=3) for rows in (1, 2)]
    one_row_kernels(model)
    assert glu_cuda.attach(model, glu_cuda.mlx_gated) == LAYERS
    monkeypatch.setenv(glu_cuda.NORM_ENV, "0")
    assert glu_cuda.fold_norms(model) is None
    monkeypatch.delenv(glu_cuda.NORM_ENV)
    assert glu_cuda.fold_norms(model).endswith(f"at one stream in {LAYERS} of {LAYERS} block(s)")
    assert compiled_blocks.attach(model) == LAYERS
    got = [steps(model, [BatchKVCache([0] * rows) for _ in range(LAYERS)], PADDED[:rows], n=3) for rows in (1, 2)]
    for rows, (w, g) in enumerate(zip(want, got, strict=True), start=1):
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert mx.array_equal(a, b).item(), f"{rows} row(s), step {step} differs"
    # one check a shape at load, then each layer's kernel traced once at one stream, never at two
    assert folded == [(1, 1, model.args.hidden_size)] * (1 + LAYERS)
    glu_cuda.detach(model)
    compiled_blocks.detach(model)


def test_a_norm_fold_that_disagrees_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A folded kernel whose result is off (here: the norm's scale left out) fails the
    load's check: no block takes it, and the load says so."""
    from gmlx.engine.kernels import glu_cuda, qgemv_cuda

    bind = _folding_bind([], disagree=True)
    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    model = _prepared("llama", quantized=True, dtype=mx.bfloat16)
    assert glu_cuda.attach(model, glu_cuda.mlx_gated) == LAYERS
    assert glu_cuda.fold_norms(model).endswith(f"in 0 of {LAYERS} block(s)")
    assert all(layer.mlp._normed is None for layer in model.layers)
    glu_cuda.detach(model)


def test_the_fold_takes_one_stream_where_the_loads_timing_did_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's whole-step timing of the gated product alone at one stream is the host's
    and within its noise (12-07 night, H100: 1.02x, not taken), so the norm's fold takes the
    gated product at one stream itself, as the q-k-v fold does: every block folded, one
    stream through the folded kernel (the same logits bit for bit where it computes what
    MLX does), the buckets the timing took kept. Where no block can fold either, the MLPs
    are their own again."""
    from gmlx.engine.kernels import glu_cuda, qgemv_cuda

    folded: list[tuple[int, ...]] = []
    monkeypatch.setattr(qgemv_cuda, "bound", _folding_bind(folded))
    model = _prepared("llama", quantized=True, dtype=mx.bfloat16)
    want = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PADDED[:1], n=3)
    one_row_kernels(model)
    assert glu_cuda.attach(model, glu_cuda.mlx_gated, buckets=(4,)) == LAYERS  # tune() took 4 rows, not one
    assert glu_cuda.fold_norms(model).endswith(f"at one stream in {LAYERS} of {LAYERS} block(s)")
    assert all(m._buckets == {1, 4} for m in glu_cuda.fused(model))
    assert compiled_blocks.attach(model) == LAYERS
    got = steps(model, [BatchKVCache([0]) for _ in range(LAYERS)], PADDED[:1], n=3)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))
    assert folded == [(1, 1, model.args.hidden_size)] * (1 + LAYERS)  # the check, then each layer traced once
    glu_cuda.detach(model)
    compiled_blocks.detach(model)

    monkeypatch.setattr(qgemv_cuda, "bound", _folding_bind([], disagree=True))
    assert glu_cuda.attach(model, glu_cuda.mlx_gated, buckets=()) == LAYERS
    assert glu_cuda.fold_norms(model).endswith(f"in 0 of {LAYERS} block(s)")
    assert glu_cuda.fused(model) == []  # taken nowhere, folded nowhere


@pytest.mark.parametrize(("mixed", "one_launch"), [(False, True), (True, True), (True, False), (True, "disagrees")],
                         ids=["one-layout", "values-8-bit", "values-8-bit-two-launches", "values-8-bit-one-disagrees"])
def test_the_norm_before_the_attention_rides_in_its_projections(monkeypatch: pytest.MonkeyPatch, mixed: bool,
                                                                 one_launch: bool | str) -> None:
    """Unless ``GMLX_QKV_NORM=0`` a block's queries, keys and values at one stream come from
    one product with the norm before them folded in (where the values' layout differs, one
    launch of two layouts, or with ``GMLX_QKV_MIXED=0`` the values from a normed product of
    their own, as where the one launch disagrees with MLX's norm and products at load): the
    same logits bit for bit where the kernels compute what MLX's norm and products do
    (``qgemv_cuda.bound`` and ``qkv_mixed.bound`` stand in with them; the kernels' own
    sources are checked in test_qgemv_cuda and test_qkv_mixed); two streams keep the norm;
    with ``GMLX_QKV_NORM=0`` nothing is folded."""
    from gmlx.engine.kernels import qgemv_cuda, qkv_cuda, qkv_mixed

    calls: list[int | str] = []

    def bind_mixed(queries, keys, values, config, norm, heads=()):
        def run(x):
            n = x if one_launch == "disagrees" else mx.fast.rms_norm(x, norm[0], norm[1])
            calls.append("mixed")
            return _per_head(x, heads, [mx.quantized_matmul(n, m.weight, m.scales, m.biases, transpose=True,
                                                            group_size=m.group_size, bits=m.bits)
                                        for m in (queries, keys, values)])
        return run

    monkeypatch.setattr(qkv_mixed, "bound", bind_mixed)
    if not one_launch:
        monkeypatch.setenv(qkv_mixed.ENV, "0")

    def bind(w, scales, biases, group_size, bits, config, more=(), norm=None, heads=(), **kw):
        def run(x):
            n = mx.fast.rms_norm(x, norm[0], norm[1])
            calls.append(1 + len(more))
            outs = _per_head(x, heads, [mx.quantized_matmul(n, *layer, transpose=True, group_size=group_size, bits=bits)
                                        for layer in ((w, scales, biases), *more)])
            return outs if more else outs[0]
        return run

    monkeypatch.setattr(qgemv_cuda, "bound", bind)
    model = _prepared("llama", quantized=True, dtype=mx.bfloat16)
    if mixed:
        for layer in model.layers:
            v = layer.self_attn.v_proj
            dense = nn.Linear(v.weight.shape[1] * 32 // v.bits, v.weight.shape[0], bias=False)
            dense.weight = mx.dequantize(v.weight, v.scales, v.biases, group_size=v.group_size, bits=v.bits)
            layer.self_attn.v_proj = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=8)
    want = [steps(model, [BatchKVCache([0] * rows) for _ in range(LAYERS)], PADDED[:rows], n=3) for rows in (1, 2)]
    monkeypatch.setenv(qkv_cuda.NORM_ENV, "0")
    assert qkv_cuda.fold_norms(model) is None  # turned off
    assert all(getattr(layer.self_attn, "_normed_project", None) is None for layer in model.layers)
    monkeypatch.delenv(qkv_cuda.NORM_ENV)  # the default
    assert qkv_cuda.fold_norms(model).endswith(f"at one stream in {LAYERS} of {LAYERS} block(s)")
    assert compiled_blocks.attach(model) == LAYERS
    calls.clear()  # (the load's check)
    got = [steps(model, [BatchKVCache([0] * rows) for _ in range(LAYERS)], PADDED[:rows], n=3) for rows in (1, 2)]
    for rows, (w, g) in enumerate(zip(want, got, strict=True), start=1):
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert mx.array_equal(a, b).item(), f"{rows} row(s), step {step} differs"
    # traced once a layer at one stream: one product of three layers, or of two and the values' own
    assert calls == ([3] if not mixed else ["mixed"] if one_launch is True else [2, 1]) * LAYERS
    compiled_blocks.detach(model)
