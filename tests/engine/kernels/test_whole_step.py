"""A one-token decode step over gmlx's batch caches as one compiled call (``whole_step``),
in the copying form (this CPU runs no CUDA kernel to write the caches in place): the same
logits bit for bit, and the same caches, as the model's own code on padded batches whose
arrays grow during the steps, one trace per width and cache length, other calls (prompt
steps, mlx-lm's caches) left to the model's own code, the in-place form falling back to
it here, traced again after a retrace, and the same tokens through gmlx's worker. Real
MLX on the CPU; tiny mlx-lm models."""

from __future__ import annotations

import logging
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from gmlx.engine.kernels import compiled_blocks, one_token, timing, traces, whole_step
from gmlx.engine.prompt_cache import _AlignedBatchKVCache
from tests.engine.kernels.models import rotated, steps, tiny

LAYERS = 3
PADDED = mx.array([[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0, 7, 7, 8, 8, 9], [0, 0, 0, 0, 0, 2, 4, 6]])


def _padded(padding: tuple[int, ...] = (0, 3, 5)) -> list[_AlignedBatchKVCache]:
    """The worker's batch caches, growing by 4 positions (the prompt's 8 keys, then 12, 16)."""
    caches = [_AlignedBatchKVCache(list(padding)) for _ in range(LAYERS)]
    for c in caches:
        c.step = 4
    return caches


def _served(family: str = "llama", quantized: bool = False, blocks: bool = True) -> nn.Module:
    model = tiny(family, LAYERS, quantized=quantized)
    assert one_token.attach(model) == LAYERS
    if blocks:
        assert compiled_blocks.attach(model) == LAYERS
    return model


def _traces(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> list[tuple[int, int]]:
    """Each one-token call of the model's own ``__call__`` (the whole step's traces):
    the width and the cache's length it met."""
    cls = type(model).__bases__[0]
    own = cls.__call__
    seen: list[tuple[int, int]] = []

    def counting(self, inputs, cache=None, *args, **kwargs):
        if inputs.shape[1] == 1:
            seen.append((inputs.shape[0], cache[0].keys.shape[2]))
        return own(self, inputs, cache, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counting)
    return seen


def _same(want: list[mx.array], got: list[mx.array]) -> None:
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"


# each family with the compiled blocks; llama without them, and unpadded (no mask in the
# model's own step, one over the whole array in the compiled one)
CASES = [(family, True, (0, 3, 5)) for family in compiled_blocks.FAMILIES]
CASES += [("llama", False, (0, 3, 5)), ("llama", True, (0, 0, 0))]


@pytest.mark.parametrize(("family", "blocks", "padding"), CASES,
                         ids=lambda v: "pad" + "".join(map(str, v)) if isinstance(v, tuple) else None)
@pytest.mark.parametrize("quantized", [False, True])
def test_the_same_logits_and_caches_bit_for_bit(family: str, blocks: bool, padding, quantized: bool) -> None:
    model = _served(family, quantized, blocks)
    want_caches, got_caches = _padded(padding), _padded(padding)
    want = steps(model, want_caches, PADDED, n=8)
    assert whole_step.attach(model, copying=True)
    got = steps(model, got_caches, PADDED, n=8)
    assert model._whole_step is not None  # the compiled step ran
    _same(want, got)
    for a, b in zip(want_caches, got_caches, strict=True):
        assert a._idx == b._idx == 16 and b.keys.shape[2] == 16  # grown past the prompt's 8
        held = [(c.offset, c.left_padding, c.keys[..., :16, :], c.values[..., :16, :]) for c in (a, b)]
        assert all(mx.array_equal(x, y).item() for x, y in zip(*held, strict=True))


def test_one_trace_per_width_and_cache_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not one per step: the steps of one cache length replay the trace, and each trace is
    kept (a second batch of the same shapes traces nothing)."""
    model = _served()
    whole_step.attach(model, copying=True)
    traced = _traces(monkeypatch, model)
    steps(model, _padded(), PADDED, n=8)
    assert traced == [(3, 12), (3, 16)]
    steps(model, _padded((0,)), PADDED[:1], n=3)
    steps(model, _padded(), PADDED, n=8)
    assert traced == [(3, 12), (3, 16), (1, 12)]


def test_other_calls_run_the_models_own_code() -> None:
    """Prompt steps, mlx-lm's plain and batch caches (no ``write_and_attend``)."""
    model = _served()

    def run() -> list[list[mx.array]]:
        plain = [KVCache() for _ in range(LAYERS)]
        batch = [BatchKVCache([0, 3, 5]) for _ in range(LAYERS)]
        return [steps(model, plain, PADDED[:1]), steps(model, batch, PADDED)]

    want = run()
    whole_step.attach(model, copying=True)
    model(PADDED, cache=_padded())
    got = run()
    assert model._whole_step is None
    for a, b in zip(want, got, strict=True):
        _same(a, b)


def test_the_in_place_form_falls_back_to_the_models_own_code_here(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """This CPU's attention does not write the cache in place: the trace fails once,
    logged (info: expected of such a model), and the model runs its own code from then on, with the same logits."""
    model = _served()
    want = steps(model, _padded(), PADDED, n=8)
    whole_step.attach(model)
    tried = []
    step = whole_step._step
    monkeypatch.setattr(whole_step, "_step", lambda *a: tried.append(1) or step(*a))
    with caplog.at_level(logging.INFO, logger=whole_step.__name__):
        got = steps(model, _padded(), PADDED, n=8)
    _same(want, got)
    assert model._whole_off and model._whole_step is None and len(tried) == 1
    # expected of a model whose layers do not write in place: said, not warned
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "the one-token step runs uncompiled: a layer's attention does not write its keys in place")]


def _attend_functional(calls: list[int]):
    """``attend_cached``'s place taken by MLX operations that a trace can hold (no CUDA
    here): the step's keys and values put at ``position`` of copies of the cache's arrays
    (not written in place), then attention over the keys so far, each stream's padding
    masked, the queries and key rotated first where a rope is folded in, as the kernel
    rotates them (float32 angles, rounded to the activations' type). The logits of one
    step are the kernel's; the cache is left as it was. ``calls`` gets each call's rope
    pairs, or ``""``."""

    def attend_cached(q, k_new, v_new, k, v, padding, position, scale, rope=None):
        calls.append(rope[2] if rope else "")
        if rope:
            q, k_new = (rotated(a, *rope) for a in (q, k_new))
        k = mx.slice_update(k, k_new, position, axes=(2,))
        v = mx.slice_update(v, v_new, position, axes=(2,))
        at = mx.arange(k.shape[2])
        live = (at[None] >= padding[:, None]) & (at[None] <= position)
        b, heads, _, d = q.shape
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=live.reshape(b, 1, 1, -1))
        return out.reshape(b, 1, heads * d)

    return attend_cached


def _fp16_llama(fold: bool) -> nn.Module:
    """A float16 llama of 64-wide heads (as the in-place kernel takes them) whose attention
    writes in place, its rope folded in with ``fold``."""
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(7)
    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=LAYERS, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    one_token.attach(model, in_place=True, fold=fold)
    return model


def test_the_rope_folded_into_the_in_place_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GMLX_ROPE_ATTENTION``'s fold: each layer hands the in-place attention its queries
    and key unrotated, with the streams' positions and its rope's frequencies (the
    stand-in rotates them as the kernel does), for the same logits as the layer's own
    rope, in its own step and through the whole step's trace; where the in-place
    attention is not taken (the copying form's caches) the layer rotates them itself,
    bit for bit as an unfolded model does. qwen3's (a norm of each head first) keeps its
    own rope."""
    from gmlx.engine.kernels import cached_attention_cuda

    plain, folded = _fp16_llama(False), _fp16_llama(True)
    assert all(layer.self_attn._fold is None for layer in plain.layers)
    assert all(layer.self_attn._fold[1] == "half" for layer in folded.layers)
    calls: list[str] = []
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", _attend_functional(calls))
    caches = {m: _padded() for m in ("plain", "folded")}
    for name, model in (("plain", plain), ("folded", folded)):
        model(PADDED, cache=caches[name])  # the prompt: the model's own code
    tokens = mx.array([[1], [2], [3]])
    want = plain(tokens, cache=[replace_cache(c) for c in caches["plain"]])
    assert calls == [""] * LAYERS
    calls.clear()
    got = folded(tokens, cache=[replace_cache(c) for c in caches["folded"]])
    assert calls == ["half"] * LAYERS
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2).item()
    calls.clear()
    whole_step.attach(folded)
    got = folded(tokens, cache=caches["folded"])
    assert folded._whole_step is not None and calls == ["half"] * LAYERS
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2).item()
    # the copying form: no in-place attention, so the layer's own rope, as the plain model's
    plain, folded = _fp16_llama(False), _fp16_llama(True)
    for model in (plain, folded):
        whole_step.attach(model, copying=True)
    _same(steps(plain, _padded(), PADDED), steps(folded, _padded(), PADDED))
    qwen3 = tiny("qwen3", 1, heads=2)
    one_token.attach(qwen3, in_place=True, fold=True)
    assert qwen3.layers[0].self_attn._fold is None


def test_the_fused_add_and_norm_blocks_in_the_whole_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gmlx-fused``'s layers (``GMLX_ADD_NORM_KERNEL=1`` with the rope folded in, MLX's
    own add and norm standing in for the add-norm kernel): each fused block hands the
    next its output as two parts inside the one traced step (one trace per width and
    cache length, the final norm fused too), for the same logits bit for bit as those
    blocks compiled in pieces; in the copying form the folded rope is the layer's own."""
    from gmlx.engine.kernels import add_norm_cuda

    def model_of(whole: bool):
        model = tiny("llama", LAYERS, dtype=mx.bfloat16, seed=7, heads=2)  # 64-wide heads, as the kernels take
        one_token.attach(model, fold=True, in_place=False)
        calls: list[int] = []

        def fused(x, r, w, eps):
            calls.append(1)
            return add_norm_cuda.mlx_add_norm(x, r, w, eps)

        assert add_norm_cuda.attach(model, fused) == LAYERS
        assert compiled_blocks.attach(model) == LAYERS
        if whole:
            whole_step.attach(model, copying=True)
        return model, calls

    (pieces, _), (model, calls) = model_of(False), model_of(True)
    want = steps(pieces, _padded(), PADDED, n=8)
    traced = _traces(monkeypatch, model)  # (counts every model of the class: after the other's steps)
    got = steps(model, _padded(), PADDED, n=8)
    _same(want, got)
    assert traced == [(3, 12), (3, 16)] and not model._whole_off
    assert len(calls) == 2 * (2 * LAYERS - 1 + 1)  # each trace: the blocks' fused adds and the final norm's


def test_the_in_place_form_is_traced_through_the_attention_that_writes_the_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The form a GPU runs: every layer's attention reaches ``attend_cached`` through the
    stand-in caches (what it reads of them, padding and position, are the trace's
    inputs), the step is one trace, and its logits are the model's own step's; then the
    cache counts the position. Float16 with 64-wide heads, as the kernel takes them."""
    from gmlx.engine.kernels import cached_attention_cuda

    model = _fp16_llama(False)
    cache = _padded()
    model(PADDED, cache=cache)
    calls: list[int] = []
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", _attend_functional(calls))
    want = model(mx.array([[1], [2], [3]]), cache=[replace_cache(c) for c in cache])  # the model's own step
    assert len(calls) == LAYERS
    calls.clear()
    whole_step.attach(model)
    traced = _traces(monkeypatch, model)
    got = model(mx.array([[1], [2], [3]]), cache=cache)
    assert not getattr(model, "_whole_off", False) and model._whole_step is not None
    assert traced == [(3, cache[0].keys.shape[2])] and len(calls) == LAYERS
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2).item()
    assert all(c._idx == 9 for c in cache)


def replace_cache(c: _AlignedBatchKVCache) -> _AlignedBatchKVCache:
    """A copy of a batch cache the model's own step may write to."""
    copy = _AlignedBatchKVCache(c.left_padding.tolist())
    copy.keys, copy.values, copy.offset, copy._idx = mx.array(c.keys), mx.array(c.values), c.offset, c._idx
    return copy


def test_a_retrace_traces_again(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _served()
    whole_step.attach(model, copying=True)
    traced = _traces(monkeypatch, model)
    caches = _padded()
    steps(model, caches, PADDED, n=2)
    assert traced == [(3, 12)] and model._whole_step is not None
    traces.retrace(model)
    assert model._whole_step is None
    steps(model, caches, PADDED[:, :1], n=0)  # a decode step over the same caches
    assert traced == [(3, 12)] * 2
    compiled_blocks.retrace(model)  # the tuners' hook: the same function
    steps(model, caches, PADDED[:, :1], n=0)
    assert traced == [(3, 12)] * 3


def test_only_the_traces_used_last_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """One trace per (width, cache length), the least recently used dropped past
    ``KEPT``: met again, it is traced again; the ones kept are not."""
    monkeypatch.setattr(whole_step, "KEPT", 2)
    model = _served()
    whole_step.attach(model, copying=True)
    next_ = PADDED[:, :1].astype(mx.uint32)  # a decode step's tokens, as steps() makes them (argmax)
    traced = _traces(monkeypatch, model)
    three, two = _padded(), _padded((0, 3))
    steps(model, three, PADDED, n=1)  # (3, 12)
    steps(model, two, PADDED[:2], n=1)  # (2, 12)
    steps(model, three, next_, n=0)  # (3, 12) again: kept, now the last used
    assert traced == [(3, 12), (2, 12)] and list(model._whole_step) == [(2, 12), (3, 12)]
    one = _padded((0,))
    steps(model, one, PADDED[:1], n=1)  # (1, 12): (2, 12) dropped
    assert list(model._whole_step) == [(3, 12), (1, 12)]
    steps(model, two, next_[:2], n=0)  # traced again
    steps(model, three, next_, n=0)  # (3, 12) was dropped by it in turn
    assert traced == [(3, 12), (2, 12), (1, 12), (2, 12), (3, 12)]


def test_the_tuners_trace_the_whole_step_again_after_each_switch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``timing.step_times`` times steps over the worker's batch cache, through the whole
    step, and has it traced again after each switch of ``use``."""
    model = _served(quantized=True)
    whole_step.attach(model, copying=True)
    traced = _traces(monkeypatch, model)
    timing.step_times(model, 2, lambda taken: None)
    # two traces a timing of 14 steps: its first step's tokens are int32 zeros, the rest
    # argmax's uint32 (a trace keys on its inputs' dtypes too)
    assert traced == [(2, 256)] * 8
    assert model._whole_step is None  # the next step traces with what the tuners left


def test_attach_and_detach() -> None:
    from mlx_lm.models import llama

    model = _served()
    assert whole_step.attach(model, copying=True) and whole_step.attached(model)
    assert not whole_step.attach(model)
    whole_step.detach(model)
    assert type(model) is llama.Model and not whole_step.attached(model)
    assert whole_step.attach(model)


def test_on_by_default_only_with_the_in_place_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    from gmlx.engine.kernels import cached_attention_cuda

    monkeypatch.delenv(whole_step.ENV, raising=False)
    monkeypatch.delenv("GMLX_CACHE_ATTENTION", raising=False)
    monkeypatch.delenv("GMLX_HANDOVER_LAYERS", raising=False)
    assert not cached_attention_cuda.cached_enabled() and not whole_step.enabled()  # no CUDA here
    monkeypatch.setattr(cached_attention_cuda.cuda_source, "available", lambda: True)
    assert cached_attention_cuda.cached_enabled() and whole_step.enabled()  # CUDA: on by default
    monkeypatch.setenv("GMLX_CACHE_ATTENTION", "0")
    assert not cached_attention_cuda.cached_enabled() and not whole_step.enabled()
    monkeypatch.setenv("GMLX_CACHE_ATTENTION", "1")
    assert whole_step.enabled()
    monkeypatch.setenv("GMLX_HANDOVER_LAYERS", "8")  # evaluates a forward's chunks as it is built
    assert not whole_step.enabled()
    monkeypatch.delenv("GMLX_HANDOVER_LAYERS")
    monkeypatch.setenv(whole_step.ENV, "0")
    assert not whole_step.enabled()


def test_a_window_or_any_error_at_the_trace_falls_back(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A layer asking for a window's mask cannot be traced (its attention would read past
    the window); anything else a trace meets (a kernel MLX refused) falls back likewise:
    the model's own code from then on, the caches changed only by it."""
    with pytest.raises(whole_step.NotWhole):
        whole_step._Copying(*(mx.zeros((1, 1, 4, 8)),) * 2, mx.array([0]), mx.array([0]),
                            mx.array([3])).make_mask(1, window_size=2)
    model = _served()
    want = steps(model, _padded(), PADDED, n=4)
    whole_step.attach(model, copying=True)

    def refused(*args, **kwargs):
        raise RuntimeError("a kernel MLX refused")

    monkeypatch.setattr(whole_step, "_trace", lambda *args: mx.compile(refused))
    with caplog.at_level(logging.WARNING, logger="gmlx.engine.kernels.whole_step"):
        got = steps(model, _padded(), PADDED, n=4)
    assert model._whole_off and [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "a kernel MLX refused" in caplog.text
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))


def test_a_fallback_after_whole_steps_had_run_is_a_warning(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A model whose layers do not take the in-place step says so at its first step (info);
    one that stops taking it after whole steps had run (a new cache length's trace refused)
    is slower from then on for a reason nobody expects: a warning, and the same logits."""
    model = _served()
    want = steps(model, _padded(), PADDED, n=8)
    whole_step.attach(model, copying=True)
    own = whole_step._trace
    traced: list[int] = []

    def second_refused(*args):
        traced.append(1)
        if len(traced) > 1:
            raise whole_step.NotWhole("a layer asked for a window")
        return own(*args)

    monkeypatch.setattr(whole_step, "_trace", second_refused)
    with caplog.at_level(logging.INFO, logger="gmlx.engine.kernels.whole_step"):
        got = steps(model, _padded(), PADDED, n=8)
    assert traced == [1, 1] and model._whole_off
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "after whole steps had run" in caplog.text and "a window" in caplog.text
    _same(want, got)


def test_the_same_tokens_through_the_worker() -> None:
    """The worker's greedy streams, joined at different steps, over its batch caches
    (``_AlignedBatchKVCache``, merged through ``with_room``'s layers)."""
    from gmlx.engine.kernels import prepare_layers
    from gmlx.engine.loading import load_model
    from gmlx.engine.types import GenerateRequest, SamplingParams
    from gmlx.engine.worker import ModelWorker

    def tokens(whole: bool) -> list[list[int]]:
        loaded = load_model("demo")
        model = tiny("qwen2", LAYERS, quantized=True)
        prepare_layers(model)
        if whole:
            assert whole_step.attach(model, copying=True)
        loaded = replace(loaded, model=model, config={**loaded.config, "vocab_size": 256})
        worker = ModelWorker(loaded, decode_batch=4, prompt_cache_bytes=0)
        try:
            greedy = SamplingParams(temperature=0.0, logit_bias={t: -100.0 for t in (0, 1, 2)})
            handles = [worker.submit(GenerateRequest(tuple(range(3 + i, 9 + 2 * i)), max_tokens=12 + i,
                                                     sampling=greedy)) for i in range(3)]
            out = [[t for ev in handle for t in (ev.token_ids or ())] for handle in handles]
            # the worker's generator stepped through it
            assert (getattr(model, "_whole_step", None) is not None) == whole
            return out
        finally:
            worker.close()

    want = tokens(False)
    assert [len(t) for t in want] == [12, 13, 14]
    assert tokens(True) == want
