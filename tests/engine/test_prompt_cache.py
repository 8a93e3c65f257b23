"""The prompt cache: tiers, warm tokens, identical output, eviction, back-pressure."""

from __future__ import annotations

import pytest

from gmlx.engine.errors import ServerOverloadedError
from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams
from gmlx.engine.worker import ModelWorker

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def worker(demo_model):
    w = ModelWorker(demo_model, decode_batch=2)
    yield w
    w.close()


def chat(demo_model, *turns: str, system: str | None = None) -> tuple[int, ...]:
    messages = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return tuple(demo_model.tokenizer.encode_chat(messages))


def generate(worker, tokens, n=12, **kw):
    events = list(worker.generate(GenerateRequest(tokens, max_tokens=n, sampling=GREEDY, **kw)))
    return "".join(e.text for e in events), events[-1]


def test_exact_repeat_hits_and_output_is_identical(worker, demo_model):
    tokens = chat(demo_model, "Tell me about Paris and London.")
    cold_text, cold = generate(worker, tokens)
    assert cold.cache_tier == "miss" and cold.usage.cached_tokens == 0
    warm_text, warm = generate(worker, tokens)
    assert warm.cache_tier in ("exact", "block")
    assert warm.usage.cached_tokens >= len(tokens) - 1 - 0
    assert warm_text == cold_text


def test_next_chat_turn_reuses_the_conversation(worker, demo_model):
    first = chat(demo_model, "Hello there")
    answer, _ = generate(worker, first)
    second = chat(demo_model, "Hello there", answer, "And then?")
    text, final = generate(worker, second)
    assert final.cache_tier == "block"
    assert final.usage.cached_tokens >= len(first) - 1
    worker.prompt_cache.reset()
    fresh_text, fresh = generate(worker, second)
    assert fresh.cache_tier == "miss"
    assert fresh_text == text  # same output with and without the cache


def test_shared_system_prompt_is_reused(worker, demo_model):
    system = "You are a careful assistant that answers about the weather in many cities. " * 3
    generate(worker, chat(demo_model, "Paris?", system=system))
    tokens = chat(demo_model, "Tokyo?", system=system)
    text, final = generate(worker, tokens)
    system_len = len(demo_model.tokenizer.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    assert final.cache_tier == "block" and final.usage.cached_tokens >= system_len - 1
    worker.prompt_cache.reset()
    assert generate(worker, tokens)[0] == text


def test_hits_share_an_entry_without_changing_it(worker, demo_model):
    """Hits start from the cached arrays themselves (no copy): trimming a shared entry
    for one request and decoding after it must leave the entry as it was."""
    system = "You answer questions about cities, briefly and with care. " * 3
    first = chat(demo_model, "Paris?", system=system)
    original, _ = generate(worker, first, n=16)
    for city in ("Tokyo?", "Lima?", "Oslo?"):  # block hits trimmed off the longer entry
        _, final = generate(worker, chat(demo_model, city, system=system), n=16)
        assert final.cache_tier == "block"
    again, final = generate(worker, first, n=16)
    assert final.cache_tier in ("exact", "block") and final.usage.cached_tokens >= len(first) - 16
    assert again == original


def test_peek_reports_what_a_fetch_would_give(worker, demo_model):
    tokens = chat(demo_model, "peek at me")
    assert worker.prompt_cache.peek(list(tokens)) == ("miss", 0)
    generate(worker, tokens)
    tier, warm = worker.prompt_cache.peek(list(tokens))
    assert tier == "exact" and warm == len(tokens) - 1
    stats = worker.prompt_cache.stats()
    assert stats["enabled"] and stats["entries"] >= 1 and stats["bytes"] > 0


def test_byte_bound_evicts_least_recently_used(demo_model):
    w = ModelWorker(demo_model, decode_batch=1, prompt_cache_bytes=1)
    try:
        tokens = chat(demo_model, "anything at all")
        generate(w, tokens)
        assert w.prompt_cache.stats()["bytes"] <= 1
        _, final = generate(w, tokens)
        assert final.cache_tier == "miss"
    finally:
        w.close()


def test_disabled_cache(demo_model):
    w = ModelWorker(demo_model, decode_batch=1, prompt_cache_bytes=0)
    try:
        tokens = chat(demo_model, "hi")
        generate(w, tokens)
        _, final = generate(w, tokens)
        assert final.cache_tier == "miss"
        assert w.prompt_cache.stats()["enabled"] is False
    finally:
        w.close()


def test_cancelled_and_stopped_requests_leave_their_kv(worker, demo_model):
    tokens = chat(demo_model, "long answer please")
    handle = worker.submit(GenerateRequest(tokens, max_tokens=500, sampling=GREEDY))
    for i, event in enumerate(handle):
        if i == 2:
            handle.cancel()
    assert event.finish_reason is FinishReason.CANCELLED
    assert worker.prompt_cache.peek(list(tokens))[0] == "exact"


def test_queue_cap_refuses_with_retry_after(demo_model):
    w = ModelWorker(demo_model, decode_batch=1, queue_cap=1)
    try:
        tokens = chat(demo_model, "busy")
        running = w.submit(GenerateRequest(tokens, max_tokens=400, sampling=GREEDY))
        queued = w.submit(GenerateRequest(tokens, max_tokens=4, sampling=GREEDY))
        with pytest.raises(ServerOverloadedError) as info:
            w.submit(GenerateRequest(tokens, max_tokens=4, sampling=GREEDY))
        err = info.value
        assert err.status == 503 and err.openai_type == "server_overloaded"
        assert 2 <= int(err.headers["Retry-After"]) <= 60
        assert w.stats.rejections == 1
        # The message counts the queue, not the request about to take the free slot.
        assert "the queue is full (1 waiting, cap 1)" in str(err)
        assert w.stats.last_reject_reason == "the queue is full (1 waiting, cap 1)"
        rows = w.rows()
        assert rows[0]["state"] == "queued" and rows[0]["position"] == 1
        running.cancel()
        assert list(queued)[-1].finish_reason is FinishReason.LENGTH
        list(running)
        # Room again once the queue drained.
        assert list(w.generate(GenerateRequest(tokens, max_tokens=2, sampling=GREEDY)))[-1].final
    finally:
        w.close()


def test_rows_and_rates(worker, demo_model):
    tokens = chat(demo_model, "rates")
    handle = worker.submit(GenerateRequest(tokens, max_tokens=300, sampling=GREEDY))
    it = iter(handle)
    for _ in range(5):
        next(it)
    (row,) = worker.rows()
    assert row["state"] == "decode" and row["id"] == handle.id and row["model"] == "demo"
    assert row["prompt_tokens"] == len(tokens) and row["generated"] >= 5 and row["max_tokens"] == 300
    assert row["ttft_s"] is not None and row["cache"]["tier"] in ("miss", "exact", "block")
    handle.cancel()
    list(it)
    rates = worker.stats.rates()
    assert rates["decode_tok_s_recent"] and rates["decode_tok_s_recent"] > 0
    assert rates["decode_tok_s_lifetime"] > 0
    assert worker.rows() == []


class FakeLayer:
    """A trimmable KV layer with no arrays: enough for the index and its byte count."""

    nbytes = 1

    def __init__(self, n: int) -> None:
        self.offset = n

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> list:
        return []


@pytest.mark.parametrize("block", [64, 4])
def test_lookup_reuses_what_mlx_lm_would(block, monkeypatch):
    """The block index picks as many warm tokens as mlx-lm's own ``LRUPromptCache``
    (a token trie, the reference) for every kind of prompt: exact, a cut from a longer
    entry, a shorter prefix, a miss; with the real block size and a tiny one (so the
    sequences span many blocks and prompts end mid-block)."""
    import random

    from mlx_lm.models.cache import LRUPromptCache

    from gmlx.engine import prompt_cache

    monkeypatch.setattr(prompt_cache, "BLOCK", block)
    rng = random.Random(7)
    cache = prompt_cache.PromptCache(1 << 30)
    reference = LRUPromptCache(max_size=1 << 30, max_bytes=1 << 40)
    stored = []
    for _ in range(40):  # conversations sharing a template-like head, some branching off others
        base = rng.choice(stored) if stored and rng.random() < 0.6 else [1, 2, 3]
        seq = base[: rng.randint(1, len(base))] + [rng.randint(4, 30) for _ in range(rng.randint(1, 90))]
        stored.append(seq)
        cache.insert(seq, [FakeLayer(len(seq))])
        reference.insert_cache("m", seq, [FakeLayer(len(seq))])
    assert cache.stats()["entries"] == len(reference)  # the same prefixes dropped
    kinds = set()
    for _ in range(600):
        probe = rng.choice(stored)
        probe = probe[: rng.randint(2, len(probe))] + [rng.randint(4, 30) for _ in range(rng.randint(0, 5))]
        if rng.random() < 0.1:  # a conversation the cache has never seen
            probe = [rng.randint(31, 40) for _ in range(rng.randint(2, 10))]
        result = reference._trie.search("m", probe)
        if result.exact is not None:
            expected = len(probe) - 1
            kinds.add("exact")
        else:
            short = len(result.shorter) if result.shorter is not None and len(result.shorter) > 1 else 0
            longer = result.longer is not None and result.common_prefix > short
            expected = min(len(probe) - 1, result.common_prefix) if longer else short
            kinds.add("longer" if longer else "shorter" if short else "miss")
        assert cache.peek(probe)[1] == expected, probe
        lookup = cache.fetch(probe)
        assert lookup.warm_tokens == expected and lookup.rest == probe[expected:]
        if lookup.cache is not None:
            assert lookup.cache[0].offset == expected  # trimmed to the warm tokens, entry untouched
    assert kinds == {"exact", "longer", "shorter", "miss"}
    assert all(e.cache[0].offset == len(e.tokens) for e in cache._entries.values())


def test_eviction_follows_use_and_frees_the_index(monkeypatch):
    """Least recently used goes first, a fetch counting as a use; an evicted entry
    leaves nothing behind in the index."""
    from gmlx.engine import prompt_cache

    monkeypatch.setattr(prompt_cache, "BLOCK", 4)
    cache = prompt_cache.PromptCache(3)  # FakeLayer weighs 1 byte: three entries fit
    a, b, c, d = ([k] * 10 for k in (5, 6, 7, 8))
    for seq in (a, b, c):
        cache.insert(seq, [FakeLayer(len(seq))])
    assert cache.fetch(a + [1]).warm_tokens == 10  # a is used: b is now the oldest
    cache.insert(d, [FakeLayer(len(d))])
    assert [e.tokens[0] for e in cache._entries.values()] == [7, 5, 8]
    assert cache.peek(b + [1]) == ("miss", 0)
    assert cache.stats()["bytes"] == 3
    cache.reset()
    assert not cache._by_key and not cache._by_end and cache.stats()["entries"] == 0


class FixedLayer(FakeLayer):
    """A KV layer that cannot be trimmed (a rotating window, say)."""

    def is_trimmable(self) -> bool:
        return False


@pytest.mark.parametrize("block", [64, 4])
def test_untrimmable_entries_are_reused_only_as_prefixes(block, monkeypatch):
    from gmlx.engine import prompt_cache

    monkeypatch.setattr(prompt_cache, "BLOCK", block)
    cache = prompt_cache.PromptCache(1 << 30)
    head = [1, 2, 3]  # shorter than a block
    turn = head + list(range(10, 40))
    longer = turn + list(range(50, 90))
    for seq in (head, turn, longer):  # untrimmable: the prefixes stay, each is needed
        cache.insert(seq, [FixedLayer(len(seq))])
    assert cache.stats()["entries"] == 3
    assert cache.peek(longer + [7, 8]) == ("block", len(longer))  # extends the longest
    assert cache.peek(turn + [60, 61]) == ("block", len(turn))  # cutting `longer` is impossible
    assert cache.peek(longer) == ("block", len(turn))  # its own entry would need one token off
    assert cache.peek(head + [99, 98]) == ("block", len(head))
    assert cache.peek([1, 2, 99]) == ("miss", 0)  # a two-token prefix is not worth it


def test_colliding_block_keys_never_reuse_another_conversation(monkeypatch):
    """Keys are hashes; should two different sequences ever get the same keys, the
    tokens decide: a prompt never starts from another conversation's KV."""
    from gmlx.engine import prompt_cache

    monkeypatch.setattr(prompt_cache, "BLOCK", 4)
    monkeypatch.setattr(prompt_cache, "_block_keys", lambda tokens: [7] * (len(tokens) // 4))
    cache = prompt_cache.PromptCache(1 << 30)
    cache.insert(list(range(100, 140)), [FakeLayer(40)])
    assert cache.peek(list(range(200, 250))) == ("miss", 0)
    assert cache.fetch(list(range(100, 140)) + [1, 2]).warm_tokens == 40  # the real one still hits


def test_a_merged_batch_has_whole_steps_and_room_for_the_prompt():
    """A batch merged from cached histories (and misses) holds what mlx-lm's merge holds,
    in arrays of whole steps with room for the prompt still to come; growing past them
    stays on whole steps, whatever length the arrays had."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from gmlx.engine.prompt_cache import with_room

    def layer(n):
        c = KVCache()
        if n:
            c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
        return c

    histories = [layer(37), layer(0), layer(300)]
    rooms = [5, 20, 260]
    layers = [with_room([h], r)[0] for h, r in zip(histories, rooms)]
    ours = layers[0].merge(layers)  # as mlx-lm merges a batch: through its first request's layer
    theirs = BatchKVCache.merge(histories)
    assert ours.keys.shape[2] % ours.step == 0 and ours.keys.shape[2] >= 300 + 260
    assert ours._idx == theirs._idx == 300
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values()):
        assert mx.array_equal(a, b)
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist() == [37, 0, 300]

    ours.filter([0, 2])  # drops no padding here; cut one position off to make it ragged
    ours.keys, ours.values = ours.keys[..., 1:, :], ours.values[..., 1:, :]
    ours._idx -= 1
    ours.left_padding -= 1
    before = [a[..., : ours._idx, :] for a in ours.keys_and_values()]
    capacity = ours.keys.shape[2]
    k = v = mx.ones((2, 2, capacity - ours._idx + 3, 8))
    ours.update_and_fetch(k, v)
    assert ours.keys.shape[2] % ours.step == 0 and ours.keys.shape[2] >= ours._idx
    for a, b in zip(before, ours.keys_and_values()):
        assert mx.array_equal(a, b[..., : a.shape[2], :])
    assert with_room([histories[2]], 1)[0].keys is histories[2].keys  # shared, never copied


def _generate(model, inserts, width: int, n: int) -> list[list[int]]:
    """``n`` greedy tokens for each (prompt, cache or None) of ``inserts``, prefilled
    together by mlx-lm's BatchGenerator and decoded ``width`` at a time."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=width, prefill_batch_size=width, stop_tokens=[])
    uids = [gen.insert([rest], max_tokens=[n], caches=[cache])[0] for rest, cache in inserts]
    out = {uid: [] for uid in uids}
    while any(len(v) < n for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    gen.close()
    return [out[uid] for uid in uids]


def test_hits_and_misses_prefilled_together_match_the_uncached_output(demo_model):
    """Hits with short and long new text and a miss, prefilled as one batch (merged
    through ``with_room``), each generate what they generate alone without a cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.prompt_cache import with_room

    model = demo_model.model
    system = "You answer questions about cities, briefly and with care. " * 3
    head = list(demo_model.tokenizer.encode_chat([{"role": "system", "content": system}],
                                                 add_generation_prompt=False))
    long_tail = "Then say more about its rivers, bridges, parks and markets. " * 30
    prompts = [list(chat(demo_model, q, system=system)) for q in ("Tokyo?", "Lima?" + long_tail, "Oslo?")]
    prompts.append(list(reversed(chat(demo_model, "Nothing shared with the others."))))  # a miss
    assert all(p[: len(head)] == head for p in prompts[:3])
    history = make_prompt_cache(model)
    model(mx.array([head]), cache=history)
    mx.eval([c.state for c in history])

    def run(inserts, width):
        return _generate(model, inserts, width, 10)

    alone = [run([(p, None)], 1)[0] for p in prompts]
    together = run([(p[len(head):], with_room(history, len(p) - len(head))) for p in prompts[:3]]
                   + [(prompts[3], with_room(make_prompt_cache(model), len(prompts[3])))], 4)
    assert together == alone
    assert all(layer.offset == len(head) for layer in history)  # the shared history is as it was


def test_a_decode_step_is_unmasked_only_while_no_stream_is_padded():
    """A batch's one-token step has no mask while no stream is padded (MLX's one-query
    attention kernel takes no mask array) and the left-padding mask otherwise, followed
    through every way the padding changes: merges, filters, assignments and in-place
    arithmetic. Prompt chunks keep their mask."""
    import mlx.core as mx

    from gmlx.engine.prompt_cache import _AlignedBatchKVCache

    cache = _AlignedBatchKVCache([0, 0])
    assert cache.make_mask(1) is None
    assert cache.make_mask(4).shape == (2, 1, 4, 4)  # a chunk: causal, as mlx-lm builds it
    assert cache.make_mask(1, return_array=True) is not None
    cache.left_padding += mx.array([0, 3])  # in place: the same array object
    assert cache.make_mask(1).tolist() == [[[[True]]], [[[False]]]]  # the padded stream sees nothing
    k = mx.ones((2, 1, 4, 8))
    cache.update_and_fetch(k, k)
    cache.filter([1])  # mlx-lm drops the padding the kept streams share
    assert cache.left_padding.tolist() == [0] and cache.make_mask(1) is None
    cache.state = (cache.keys, cache.values, cache.offset, mx.array([2]), cache._idx)
    assert cache.make_mask(1) is not None


def test_the_batch_cache_a_tuner_times_is_the_workers(demo_model):
    """``batch_cache``: a layer each, as the worker's generator holds them for ``rows``
    empty streams (unmasked one-token steps, the position an array); None for a model
    whose layers are not all plain KV caches (a sliding window, a recurrent state)."""
    from mlx_lm.models.cache import RotatingKVCache

    from gmlx.engine.prompt_cache import _AlignedBatchKVCache, batch_cache

    model = demo_model.model
    layers = batch_cache(model, 3)
    assert len(layers) == len(model.layers) and all(type(c) is _AlignedBatchKVCache for c in layers)
    assert layers[0].offset.tolist() == [0, 0, 0] and layers[0].make_mask(1) is None

    class Windowed:
        layers = model.layers

        def make_cache(self):
            return [RotatingKVCache(max_size=16) for _ in self.layers]

    assert batch_cache(Windowed(), 3) is None


def test_unmasked_decode_steps_generate_what_each_prompt_generates_alone(demo_model, monkeypatch):
    """Prompts of one length decode as a batch without masks and generate exactly what
    each generates alone; with a longer prompt among them the steps are masked again."""
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.engine.prompt_cache import _AlignedBatchKVCache, with_room

    model = demo_model.model
    steps: list[bool] = []  # per one-token step: was it masked
    make_mask = _AlignedBatchKVCache.make_mask

    def recording(self, N, *args, **kwargs):
        mask = make_mask(self, N, *args, **kwargs)
        if N == 1:
            steps.append(mask is not None)
        return mask

    monkeypatch.setattr(_AlignedBatchKVCache, "make_mask", recording)

    def run(prompts):
        return _generate(model, [(p, with_room(make_prompt_cache(model), len(p))) for p in prompts],
                         len(prompts), 8)

    base = list(chat(demo_model, "Which city?"))
    same = [base[:3] + [base[3] + i] + base[4:] for i in (0, 1, 2)]  # one length, different tokens
    alone = [run([p])[0] for p in same]
    steps.clear()
    assert run(same) == alone
    assert steps and not any(steps)
    longer = list(chat(demo_model, "And now something a good deal longer than the others."))
    steps.clear()
    assert run(same[:2] + [longer]) == alone[:2] + [run([longer])[0]]
    assert any(steps)
