"""Each sampler's effect on the distribution, on hand-made log-probabilities and
through the demo model."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from gmlx.engine import sampling
from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import GenerateRequest, SamplingParams

PROBS = [0.5, 0.2, 0.15, 0.1, 0.04, 0.01]


def logprobs(probs=PROBS) -> mx.array:
    return mx.log(mx.array([probs]))


def kept(lp: mx.array) -> list[int]:
    return [i for i, v in enumerate(lp[0].tolist()) if v != -math.inf]


def test_top_n_sigma_keeps_logits_near_the_max():
    lp = logprobs()
    values = lp[0].tolist()
    mean = sum(values) / len(values)
    sigma = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    expected = [i for i, v in enumerate(values) if v >= max(values) - 1.0 * sigma]
    assert kept(sampling.apply_top_n_sigma(lp, 1.0)) == expected
    assert 0 < len(expected) < len(values)


def test_typical_p_keeps_the_tokens_closest_to_the_entropy():
    lp = logprobs()
    entropy = -sum(p * math.log(p) for p in PROBS)
    order = sorted(range(len(PROBS)), key=lambda i: abs(-math.log(PROBS[i]) - entropy))
    expected, mass = [], 0.0
    for i in order:
        if mass >= 0.5:
            break
        expected.append(i)
        mass += PROBS[i]
    assert kept(sampling.apply_typical_p(lp, 0.5)) == sorted(expected)
    assert kept(sampling.apply_typical_p(lp, 1e-9)) == [order[0]]  # never empty


def test_p_less_keeps_tokens_above_the_collision_probability():
    collision = sum(p * p for p in PROBS)
    assert kept(sampling.apply_p_less(logprobs())) == [i for i, p in enumerate(PROBS) if p >= collision]


def test_xtc_drops_the_top_choices_but_the_least_likely_of_them():
    lp = logprobs()
    on, off = mx.array([[0.0]]), mx.array([[0.99]])
    # Tokens at or above 0.14: 0, 1, 2; all but the least likely (2) are dropped.
    assert kept(sampling.apply_xtc(lp, on, 0.5, 0.14, None)) == [2, 3, 4, 5]
    assert kept(sampling.apply_xtc(lp, off, 0.5, 0.14, None)) == list(range(6))  # coin says no
    assert kept(sampling.apply_xtc(lp, on, 0.5, 0.45, None)) == list(range(6))  # only one above
    assert kept(sampling.apply_xtc(lp, on, 0.5, 0.14, mx.array([0]))) == [0, 2, 3, 4, 5]  # protected


def prompt(demo_model):
    return tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "Sample me"}]))


def token_ids(worker, demo_model, params, n=24):
    events = worker.generate(GenerateRequest(prompt(demo_model), max_tokens=n, sampling=params))
    return [t for e in events for t in e.token_ids]


@pytest.mark.parametrize(
    "narrow",
    [
        SamplingParams(temperature=1.0, seed=4, top_n_sigma=1e-6),
        SamplingParams(temperature=1.0, seed=4, typical_p=1e-9, min_p=0.0),
    ],
)
def test_extreme_settings_collapse_to_one_choice(demo_worker, demo_model, narrow):
    """top_n_sigma near 0 leaves only the argmax; tiny typical_p leaves only the
    token nearest the entropy, so two seeds give the same output."""
    other_seed = SamplingParams(**{**narrow.__dict__, "seed": 99})
    assert token_ids(demo_worker, demo_model, narrow) == token_ids(demo_worker, demo_model, other_seed)


def test_top_n_sigma_near_zero_is_greedy(demo_worker, demo_model):
    greedy = token_ids(demo_worker, demo_model, SamplingParams(temperature=0))
    assert token_ids(demo_worker, demo_model, SamplingParams(temperature=2.0, seed=1, top_n_sigma=1e-6)) == greedy


def test_xtc_always_on_never_picks_the_greedy_token_when_it_has_rivals(demo_worker, demo_model):
    """With probability 1 and a low threshold, the most likely token is excluded
    whenever another token also reaches the threshold."""
    greedy_first = token_ids(demo_worker, demo_model, SamplingParams(temperature=0), n=1)[0]
    firsts = {
        token_ids(demo_worker, demo_model,
                  SamplingParams(temperature=1.0, seed=s, xtc_probability=1.0, xtc_threshold=0.01), n=1)[0]
        for s in range(6)
    }
    assert greedy_first not in firsts


def test_seeded_xtc_and_filters_are_repeatable(demo_worker, demo_model):
    params = SamplingParams(temperature=1.2, seed=7, xtc_probability=0.5, xtc_threshold=0.05, typical_p=0.9,
                            p_less=True)
    assert token_ids(demo_worker, demo_model, params) == token_ids(demo_worker, demo_model, params)


@pytest.mark.parametrize(
    "params, name",
    [
        (SamplingParams(top_n_sigma=-1), "top_n_sigma"),
        (SamplingParams(typical_p=0), "typical_p"),
        (SamplingParams(xtc_probability=2), "xtc_probability"),
        (SamplingParams(xtc_threshold=-0.1), "xtc_threshold"),
    ],
)
def test_out_of_range_values_are_refused(params, name):
    with pytest.raises(InvalidRequestError) as info:
        sampling.validate(params, vocab_size=100)
    assert info.value.param == name


def test_a_batch_bias_is_each_rows_bias_added_to_its_row():
    vocab = 50
    logits = mx.random.normal((4, vocab), key=mx.random.key(0)).astype(mx.bfloat16)
    a = sampling.LogitBias({3: -100, 7: 2.5, 49: 0.25})
    b = sampling.LogitBias({0: 1.0, 3: 4.0})
    batch = sampling.BatchBias()

    def row_by_row(biases):
        rows = [logits[e:e + 1] if bias is None else bias(None, logits[e:e + 1]) for e, bias in enumerate(biases)]
        return mx.concatenate(rows, axis=0)

    for biases in ([a, None, b, a], [a, None, b, a], [None, b, None, None], [None] * 4, [b, a, a, b]):
        together = batch.apply(logits, biases)  # the rows change between calls: rebuilt
        assert together.dtype == logits.dtype
        assert mx.array_equal(together, row_by_row(biases)).item(), biases
    assert batch.apply(logits, [None] * 4) is logits


def test_logit_bias_comes_first_and_unguarded_among_a_requests_processors():
    params = SamplingParams(logit_bias={5: -100.0}, repetition_penalty=1.3)
    processors = sampling.make_processors(params)
    assert isinstance(processors[0], sampling.LogitBias) and len(processors) == 2
    assert processors[0].ids == [5] and processors[0].values == [-100.0]
    assert sampling.make_processors(SamplingParams()) == []
