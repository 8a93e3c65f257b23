"""KV-cache quantization in the engine: the config, greedy equality batched and alone
and across prefix-cache hits, the listing's object, and the memory it is priced at."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest

from gmlx.config import load_settings
from gmlx.engine import capacity as cap
from gmlx.engine import kv_cache
from gmlx.engine.capacity import quantized_geometry
from gmlx.engine.errors import ConfigError
from gmlx.engine.kv_cache import QuantKVCache
from gmlx.engine.kv_layers import describe, make_cache
from gmlx.engine.kv_quant import KVQuant
from gmlx.engine.types import GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker

# The demo's head dimension is 32, so its layers quantize in groups of 32.
UNIFORM8 = KVQuant("uniform", 8, 32)
UNIFORM4 = KVQuant("uniform", 4, 32)
KVARN = KVQuant("kvarn", 4, 32, value_bits=2, tail_tokens=16)
LATE = KVQuant("uniform", 4, 32, start=100)
SCHEMES = [UNIFORM4, KVARN, LATE]
PROMPTS = [[(i * 7 + j * 13) % 700 + 3 for i in range(n)] for j, n in enumerate((30, 300, 77, 5))]


def _tokens(worker: ModelWorker, prompt: list[int], n: int = 24) -> list[int]:
    out: list[int] = []
    req = GenerateRequest(tuple(prompt), max_tokens=n, sampling=SamplingParams(temperature=0))
    for event in worker.generate(req):
        out += list(event.token_ids or ())
    return out


def _together(worker: ModelWorker, prompts: list[list[int]]) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        outs[i] = _tokens(worker, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return outs


@pytest.fixture
def workers(demo_model):
    made: list[ModelWorker] = []

    def make(kvq: KVQuant | None, **kw) -> ModelWorker:
        kw.setdefault("prompt_cache_bytes", 0)
        made.append(ModelWorker(demo_model, kv_quant=kvq, **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


# -- config ---------------------------------------------------------------------------------


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gmlx.yaml"
    path.write_text(f"models:\n  m:\n    source: demo\n    kv_quant: {body}\n")
    return path


def test_a_kv_quant_config_loads_into_the_models_spec(tmp_path):
    from gmlx.compose import model_spec

    settings = load_settings(_config(tmp_path, "{scheme: kvarn, bits: 4, value_bits: 2, tail_tokens: 64, start: 10}"))
    spec = model_spec("m", settings.models["m"])
    assert spec.kv_quant == KVQuant("kvarn", 4, 64, value_bits=2, tail_tokens=64, start=10)
    assert spec.kv_quant.tail == 64 and spec.kv_quant.val_bits == 2


@pytest.mark.parametrize(("body", "key", "why"), [
    ("{scheme: fancy}", "models.m.kv_quant.scheme", "uniform"),
    ("{bits: 7}", "models.m.kv_quant.bits", "cannot be packed"),
    ("{bits: 4, group_size: 48}", "models.m.kv_quant.group_size", "not a group size"),
    ("{scheme: kvarn, value_bits: 1}", "models.m.kv_quant.value_bits", "cannot be packed"),
    ("{scheme: uniform, tail_tokens: 8}", "models.m.kv_quant.tail_tokens", "only the kvarn"),
    ("{start: -1}", "models.m.kv_quant.start", "greater than or equal"),
    ("{bitz: 4}", "models.m.kv_quant.bitz", "unknown key"),
])
def test_a_bad_kv_quant_is_a_config_error_naming_the_key(tmp_path, body, key, why):
    with pytest.raises(ConfigError) as err:
        load_settings(_config(tmp_path, body))
    assert f"invalid at {key}:" in str(err.value) and why in str(err.value)


# -- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("kvq", [UNIFORM8, *SCHEMES], ids=lambda k: f"{k.scheme}{k.bits}s{k.start}")
def test_greedy_output_batched_equals_alone(workers, kvq):
    alone = workers(kvq, decode_batch=1)
    solo = [_tokens(alone, p) for p in PROMPTS]
    assert _together(workers(kvq, decode_batch=4), PROMPTS) == solo


@pytest.mark.parametrize("kvq", [UNIFORM8, UNIFORM4, LATE], ids=lambda k: f"{k.scheme}{k.bits}s{k.start}")
def test_dequantized_attention_reads_what_attention_over_the_codes_reads(workers, kvq, monkeypatch):
    """Where MLX cannot multiply by the codes (CUDA), the cache hands attention the
    dequantized keys and values: the same numbers, so the same greedy output, batched
    and alone. (Forced here on the CPU, where both ways run.)"""
    def reads_codes() -> bool:  # mlx-lm's attention takes the codes where ``bits`` shows
        cache = QuantKVCache(kvq)
        for n in (300, 1):  # a prompt past ``start``, then a decode step
            cache.update_and_fetch(*(mx.random.normal((1, 2, n, 32)) for _ in range(2)))
        return hasattr(cache, "bits")

    on_codes = [_tokens(workers(kvq, decode_batch=1), p) for p in PROMPTS]
    assert reads_codes()
    monkeypatch.setattr(kv_cache, "codes_attention", lambda: False)
    assert not reads_codes()
    assert [_tokens(workers(kvq, decode_batch=1), p) for p in PROMPTS] == on_codes
    assert _together(workers(kvq, decode_batch=4), PROMPTS) == on_codes


def test_the_quantized_cache_changes_what_the_model_reads(workers):
    """At 4 bits the KV is lossy: greedy output parts from full precision somewhere."""
    full = [_tokens(workers(None, decode_batch=1), p) for p in PROMPTS]
    quant = [_tokens(workers(UNIFORM4, decode_batch=1), p) for p in PROMPTS]
    assert full != quant


@pytest.mark.parametrize("kvq", SCHEMES, ids=lambda k: f"{k.scheme}{k.bits}s{k.start}")
def test_a_prefix_hit_and_chunked_prefill_are_exact_against_the_quantized_cache(workers, kvq):
    prompt = [(i * 7) % 700 + 3 for i in range(200)]
    cold = workers(kvq, decode_batch=1)
    chunked = workers(kvq, decode_batch=1, prefill_step_size=37)
    warm = workers(kvq, decode_batch=1, prompt_cache_bytes=1 << 30)
    first = _tokens(warm, prompt)
    assert first == _tokens(cold, prompt) == _tokens(chunked, prompt)
    follow = prompt + first + [5, 6, 7] + prompt[:20]
    assert _tokens(warm, follow) == _tokens(cold, follow)
    assert warm.prompt_cache.stats()["tiers"]["block"] == 1  # the second turn hit
    entry = next(iter(warm.prompt_cache._entries.values()))
    assert all(isinstance(layer, QuantKVCache) for layer in entry.cache)  # stored quantized


def test_an_exact_repeat_hits_the_uniform_cache_and_matches(workers):
    prompt = [(i * 11) % 700 + 3 for i in range(150)]
    warm = workers(UNIFORM4, decode_batch=1, prompt_cache_bytes=1 << 30)
    first = _tokens(warm, prompt)
    assert _tokens(warm, prompt) == first
    assert warm.prompt_cache.stats()["tiers"]["exact"] == 1


# -- listing, pricing, memory ---------------------------------------------------------------


def test_describe_says_which_layers_took(demo_model):
    out = describe(demo_model, KVARN)
    assert out == {"scheme": "kvarn", "bits": 4, "group_size": 32, "start": 0, "layers_quantized": 2,
                   "layers_fp16": 0, "verdict": "full", "verdict_batched": "full",
                   "value_bits": 2, "tail_tokens": 16}
    dropped = describe(demo_model, KVQuant("uniform", 8, 64))  # 64 does not divide 32
    assert dropped["verdict"] == "dropped" and dropped["layers_fp16"] == 2
    assert "value_bits" not in dropped


def test_kv_is_priced_at_the_quantized_width(demo_model):
    fp = cap.probe_geometry(demo_model)
    q8, q4 = cap.probe_geometry(demo_model, UNIFORM8), cap.probe_geometry(demo_model, UNIFORM4)
    # float32 heads of 32: 8 bits -> 32 code bytes + 2 x 4 bytes of scale and bias, vs 128
    assert fp.kv_bytes_per_token / q8.kv_bytes_per_token == 128 / 40
    assert fp.kv_bytes_per_token / q4.kv_bytes_per_token == 128 / 24
    assert quantized_geometry(fp, demo_model.config, UNIFORM8) == q8  # what `gmlx plan --kv-bits` uses
    depth, chunk = 8192, 512  # the demo's whole context
    budget = 8 * cap.kv_bytes(fp, depth) + cap.prefill_transient(fp, chunk, depth)
    assert cap.max_width(fp, depth, budget, chunk) == 8
    assert cap.max_width(q8, depth, budget, chunk) == int(8 * 128 / 40)  # 25: the factor, floored
    kvarn = cap.probe_geometry(demo_model, KVARN)
    assert kvarn.layers[0].fixed_bytes == 16 * 2 * 2 * 32 * 4  # the full-precision tail


@pytest.mark.parametrize("kvq", [UNIFORM8, KVARN], ids=["uniform8", "kvarn"])
def test_active_memory_after_a_long_prompt_matches_the_prediction(demo_model, kvq):
    """The cache's arrays after a 3000-token prompt are what the memory model says."""
    geom = cap.probe_geometry(demo_model, kvq)
    tokens = 3000
    mx.synchronize()
    base = mx.get_active_memory()
    cache = make_cache(demo_model, kvq)
    prompt = mx.array([[(i * 7) % 700 + 3 for i in range(tokens)]])
    for at in range(0, tokens, 512):
        demo_model.model(prompt[:, at : at + 512], cache=cache)
        mx.eval([c.state for c in cache])
    mx.synchronize()
    held = mx.get_active_memory() - base
    predicted = cap.kv_bytes(geom, tokens)
    assert sum(c.nbytes for c in cache) == predicted
    assert 0.85 <= predicted / held <= 1.15, f"predicted/measured = {predicted / held:.3f}"
    del cache


# -- with speculative decoding ----------------------------------------------------------------


def test_trim_rows_keeps_each_rows_own_prefix_in_the_codes():
    """A speculative round keeps a different count of its positions per row: the
    quantized cache moves each row's codes as the full-precision one moves its keys,
    also side by side in one model (layers whose heads do not quantize stay mlx-lm's)."""
    from mlx_lm.models.cache import KVCache

    from gmlx.engine.spec_cache import trim_rows

    quantized, plain = [], []
    for length in (3, 5):
        keys = mx.broadcast_to(mx.arange(length, dtype=mx.float32)[:, None] + 10 * length, (length, 32))
        for made, c in ((quantized, QuantKVCache(UNIFORM8)), (plain, KVCache())):
            c.update_and_fetch(keys.reshape(1, 1, length, 32), mx.zeros((1, 1, length, 32)))
            made.append(c)
    layers = [QuantKVCache.merge(quantized), KVCache.merge(plain)]
    for c in layers:
        c.update_and_fetch(mx.full((2, 1, 4, 32), -1.0), mx.zeros((2, 1, 4, 32)))  # 4 new each
    trim_rows(layers, 4, [1, 3])
    batch, full = layers

    def first_column(c: QuantKVCache) -> list[float]:
        assert c.kq is not None
        return mx.dequantize(*c.kq, group_size=32, bits=8)[0, 0, : c.size(), 0].tolist()

    assert [round(v) for v in first_column(batch.extract(0))] == [30, 31, 32, -1]
    assert [round(v) for v in first_column(batch.extract(1))] == [50, 51, 52, 53, 54, -1, -1, -1]
    assert batch.offset.tolist() == [4, 8]
    assert batch.size() == 8  # the padding both rows shared is gone
    assert full.extract(0).keys[0, 0, :, 0].tolist() == [30, 31, 32, -1]
    assert full.extract(1).keys[0, 0, :, 0].tolist() == [50, 51, 52, 53, 54, -1, -1, -1]
    assert full.offset.tolist() == batch.offset.tolist()
    assert full.left_padding.tolist() == batch.left_padding.tolist()


@pytest.mark.parametrize("kvq", [UNIFORM4, KVARN], ids=["uniform4", "kvarn"])
@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_speculative_greedy_output_equals_undrafted_over_the_quantized_cache(demo_model, workers, drafter, kvq,
                                                                            monkeypatch):
    """Drafted and verified against the quantized KV (kvarn's full-precision tail kept
    ``draft_tokens + 1`` positions longer): the same tokens as the same quantized model
    decoding one token at a time, alone, batched and on a prefix-cache hit."""
    from gmlx.engine import spec_cache
    from gmlx.engine.drafting import DraftSpec
    from gmlx.engine.speculative import load_speculation

    rounds: list[tuple[bool, bool]] = []  # per trim: a quantized cache (not the drafter's)?, rows moved?
    trim_rows = spec_cache.trim_rows

    def counted(cache, added, keep):
        rounds.append((isinstance(cache[0], QuantKVCache), len(set(keep)) > 1))
        trim_rows(cache, added, keep)

    monkeypatch.setattr(spec_cache, "trim_rows", counted)
    spec = DraftSpec(draft_source="demo") if drafter == "self" else DraftSpec(prompt_lookup=True, draft_tokens=5)
    drafting = workers(kvq.for_drafts(spec.draft_tokens), decode_batch=4, prompt_cache_bytes=1 << 30,
                       speculation=load_speculation(spec, demo_model))
    want = [_tokens(workers(kvq, decode_batch=1), p) for p in PROMPTS]
    assert [_tokens(drafting, p) for p in PROMPTS] == want
    assert _together(drafting, PROMPTS) == want
    follow = PROMPTS[1] + want[1] + [5, 6, 7]
    assert _tokens(drafting, follow) == _tokens(workers(kvq, decode_batch=1), follow)
    assert drafting.prompt_cache.stats()["tiers"]["block"] >= 1
    assert any(quantized for quantized, _ in rounds)  # verified over the quantized cache
    if drafter == "self":  # rows keeping different counts (their max_tokens) moved within the codes
        assert any(quantized and moved for quantized, moved in rounds)


def test_a_decode_step_over_unpadded_codes_has_no_mask():
    """As with a plain cache, a one-token step needs no mask while no stream is padded
    (the greedy tests above show the output unchanged); padded streams, prompt chunks and
    a mixed scheme's two-part keys keep theirs."""
    assert QuantKVCache(UNIFORM8, [0, 0]).make_mask(1) is None
    assert QuantKVCache(UNIFORM8, [0, 2]).make_mask(1).tolist() == [[[[True]]], [[[False]]]]
    assert QuantKVCache(UNIFORM8, [0, 0]).make_mask(3) is not None
    assert QuantKVCache(KVARN, [0, 0]).make_mask(1) is not None  # full-precision tail beside the codes
