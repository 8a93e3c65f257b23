"""Speculative decoding through the worker on the demo model: greedy output is the
undrafted output token for token (widths 1 and 4, a prefix-cache hit, stop strings,
logprobs), sampled output keeps the target's distribution, and bad drafters are
refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from scipy.stats import chisquare

from gmlx.engine.drafting import DraftSpec, SpecStats
from gmlx.engine.errors import InvalidRequestError, ModelSourceError
from gmlx.engine.spec_cache import trim_rows
from gmlx.engine.speculative import Speculation, SpeculativeBatch, load_speculation, policy_for
from gmlx.engine.structured import compile_format
from gmlx.engine.types import FinishReason, GenerateRequest, ResponseFormat, SamplingParams
from gmlx.engine.worker import ModelWorker

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["Hello, world! How are you", "def main(argv", "The quick brown fox", "SELECT id, name FROM users"]
EDIT = ("Rename x to y in: def add(a, b):\n    x = a + b\n    return x\n"
        "def add(a, b):\n    x = a + b\n    return x\n")


@pytest.fixture(scope="module")
def random_drafter(demo_model):
    """A draft model of the demo's vocabulary with other random weights: it drafts
    what the target almost never says (zero acceptance)."""
    from gmlx.engine.loading import load_model

    other = load_model("demo")
    mx.random.seed(7)
    other.model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.5, other.model.parameters()))
    mx.eval(other.model.parameters())  # here: the worker's thread cannot run this thread's graph
    return Speculation(DraftSpec(draft_source="random", draft_tokens=3), other)


@pytest.fixture(scope="module")
def workers(demo_model, random_drafter):
    made = {
        "base": ModelWorker(demo_model, decode_batch=4),
        "self": ModelWorker(demo_model, decode_batch=4,
                            speculation=load_speculation(DraftSpec(draft_source="demo"), demo_model)),
        "lookup": ModelWorker(demo_model, decode_batch=4, speculation=load_speculation(
            DraftSpec(prompt_lookup=True, draft_tokens=5), demo_model)),
        "random": ModelWorker(demo_model, decode_batch=4, speculation=random_drafter),
    }
    yield made
    for w in made.values():
        w.close()


def run(worker, requests):
    """Submit all at once (they share the batch); each request's events."""
    handles = [worker.submit(r) for r in requests]
    return [list(h) for h in handles]


def ids(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def live_row(worker, request) -> dict:
    """The metrics row of ``request`` once 24 of its tokens came (then it is cancelled)."""
    handle = worker.submit(request)
    events = iter(handle)
    got = 0
    while got < 24:
        got += len(next(events).token_ids)
    (row,) = [r for r in worker.rows() if r["id"] == handle.id]
    handle.cancel()
    list(events)
    return row


def greedy(tok, text: str, **kw) -> GenerateRequest:
    return GenerateRequest(tuple(tok.encode(text)), max_tokens=kw.pop("max_tokens", 48), sampling=GREEDY, **kw)


@pytest.mark.parametrize("drafter", ["self", "lookup", "random"])
def test_greedy_output_is_identical_at_widths_1_and_4(workers, demo_model, drafter):
    tok = demo_model.tokenizer
    want = [ids(e) for e in run(workers["base"], [greedy(tok, p) for p in [*PROMPTS, EDIT]])]
    alone = [ids(run(workers[drafter], [greedy(tok, p)])[0]) for p in [*PROMPTS, EDIT]]
    together = [ids(e) for e in run(workers[drafter], [greedy(tok, p) for p in [*PROMPTS, EDIT]])]
    assert alone == want
    assert together == want


def test_self_drafting_accepts_everything_and_random_drafting_almost_nothing(workers, demo_model):
    tok = demo_model.tokenizer
    for name, low, high in (("self", 1.0, 1.0), ("random", 0.0, 0.2)):
        spec = live_row(workers[name], greedy(tok, PROMPTS[0], max_tokens=1000))["speculative"]
        assert spec["rounds"] >= 1 and spec["drafted"] >= spec["accepted"]
        if spec["drafted"]:
            assert low <= spec["accept_rate"] <= high


def test_undrafted_worker_rows_say_null(workers, demo_model):
    row = live_row(workers["base"], greedy(demo_model.tokenizer, PROMPTS[1], max_tokens=1000))
    assert row["speculative"] is None


@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_prefix_cache_hit_gives_the_same_output(workers, demo_model, drafter):
    tok = demo_model.tokenizer
    first = greedy(tok, EDIT, max_tokens=24)
    (events,) = run(workers[drafter], [first])
    follow = tok.decode(list(first.prompt_tokens) + ids(events)) + " and then"
    (hit,) = run(workers[drafter], [greedy(tok, follow)])
    (want,) = run(workers["base"], [greedy(tok, follow)])
    assert hit[-1].cache_tier not in (None, "miss")
    assert ids(hit) == ids(want)


@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_stop_strings_end_at_the_same_place(workers, demo_model, drafter):
    tok = demo_model.tokenizer
    (full,) = run(workers["base"], [greedy(tok, PROMPTS[2], max_tokens=64)])
    text = "".join(e.text for e in full)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    reqs = [greedy(tok, PROMPTS[2], max_tokens=64, stop=(stop,)) for _ in range(2)]
    want = run(workers["base"], reqs[:1])[0]
    got = run(workers[drafter], reqs)
    for events in got:
        assert "".join(e.text for e in events) == "".join(e.text for e in want)
        assert events[-1].finish_reason is FinishReason.STOP
        assert events[-1].stop_sequence == stop


@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_logprobs_match(workers, demo_model, drafter):
    tok = demo_model.tokenizer
    reqs = [greedy(tok, p, max_tokens=32, logprobs=True, top_logprobs=3) for p in PROMPTS]
    want = run(workers["base"], reqs)
    got = run(workers[drafter], reqs)
    for a, b in zip(want, got, strict=True):
        a = [e for e in a if e.token_ids]
        b = [e for e in b if e.token_ids]
        assert [e.token_ids for e in a] == [e.token_ids for e in b]
        assert np.allclose([e.logprob for e in a], [e.logprob for e in b], atol=1e-4)
        assert [[t for t, _ in e.top_logprobs] for e in a] == [[t for t, _ in e.top_logprobs] for e in b]


def test_sampled_requests_run_and_count(workers, demo_model):
    tok = demo_model.tokenizer
    reqs = [GenerateRequest(tuple(tok.encode(p)), max_tokens=40,
                            sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=i))
            for i, p in enumerate(PROMPTS)]
    for events in run(workers["self"], reqs):
        assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert events[-1].usage.completion_tokens >= 1


def test_acceptance_rule_keeps_the_target_distribution(demo_model):
    """Draft the target's most likely token and apply the acceptance rule many times:
    the emitted token (the draft, or a draw from the residual) follows the target's
    softmax (chi-square, fixed seeds, 3000 draws)."""
    model = demo_model.model
    prompt = mx.array(demo_model.tokenizer.encode("The weather in Paris is"))[None]
    logits = model(prompt)[0, -2:]  # two positions: the drafted one and the bonus
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target = np.array(mx.softmax(logprobs[0] / 0.9, axis=-1), dtype=np.float64)
    target /= target.sum()
    draft = int(np.argmax(target))
    drafts = mx.array([draft], dtype=mx.uint32)
    policy = policy_for(SamplingParams(temperature=0.9, seed=11), False, SpecStats())
    batch = SpeculativeBatch(model, None, 1, lambda uid, p: policy)
    counts = np.zeros(target.shape[0])
    for _ in range(3000):
        pick = batch._sampled_pick(policy, logprobs, drafts)
        n, token, _ = batch._decide(pick, [draft], 1, logprobs)
        counts[draft if n == 1 else token] += 1
    expected = target * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    assert chisquare(observed, wanted).pvalue > 0.001
    assert 0.05 < counts[draft] / counts.sum() < 0.95  # both branches ran


def test_trim_rows_keeps_each_rows_own_prefix():
    from mlx_lm.models.cache import KVCache

    rows = []
    for length in (3, 5):
        c = KVCache()
        c.update_and_fetch(mx.arange(length, dtype=mx.float32).reshape(1, 1, length, 1) + 10 * length,
                           mx.zeros((1, 1, length, 1)))
        rows.append(c)
    batch = KVCache.merge(rows)
    batch.update_and_fetch(mx.full((2, 1, 4, 1), -1.0), mx.zeros((2, 1, 4, 1)))  # 4 new each
    trim_rows([batch], 4, [1, 3])
    assert batch.extract(0).keys.flatten().tolist() == [30, 31, 32, -1]
    assert batch.extract(1).keys.flatten().tolist() == [50, 51, 52, 53, 54, -1, -1, -1]
    assert batch.offset.tolist() == [4, 8]


def test_structured_request_to_a_speculative_model_is_refused(workers, demo_model):
    grammar = compile_format(ResponseFormat(kind="json_object"))
    with pytest.raises(InvalidRequestError) as e:
        workers["self"].submit(GenerateRequest(tuple(demo_model.tokenizer.encode("Hi")), grammar=grammar))
    assert e.value.param == "response_format"


def test_draft_model_with_another_vocabulary_is_refused(demo_model):
    with pytest.raises(ModelSourceError, match="tokenizer"):
        load_speculation(DraftSpec(draft_source="demo-vision"), demo_model)
