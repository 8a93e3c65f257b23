"""The mlx-lm adapter against the installed mlx-lm: each private name gmlx reads still
means what the adapter says. After an mlx-lm upgrade, this file fails first."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from gmlx.engine import mlxlm


def test_model_classes_for_a_known_and_an_unknown_type(demo_model):
    model_cls, args_cls = mlxlm.model_classes(demo_model.config)
    assert isinstance(demo_model.model, model_cls) and hasattr(args_cls, "from_dict")
    with pytest.raises(ValueError):
        mlxlm.model_classes({"model_type": "no_such_architecture"})


def test_infer_tool_parser_reads_the_template():
    hf = SimpleNamespace(chat_template="<tool_call>{{ tool_call.name }}</tool_call>", get_vocab=dict)
    assert mlxlm.infer_tool_parser(hf) == "json_tools"
    assert mlxlm.infer_tool_parser(SimpleNamespace(chat_template="plain", get_vocab=dict)) is None


def test_prefill_lengths_and_the_first_token_follow_the_generator(demo_model):
    eos = sorted(demo_model.tokenizer.eos_token_ids)
    gen = mlxlm.batch_generator(demo_model.model, eos, width=2, prefill_step=64)
    try:
        prompt = [(7 * i + 3) % 300 + 10 for i in range(100)]
        (uid,) = gen.insert([prompt], max_tokens=[4])
        assert mlxlm.prefill_lengths(gen) == [99]  # the last token goes in on its own
        assert mlxlm.first_token(gen, uid) is None  # not decoding yet
        gen.next()
        assert mlxlm.prefill_lengths(gen) == [35]  # one 64-token chunk done
        gen.next()
        assert mlxlm.prefill_lengths(gen) == [0]  # only its last token, for its first decode step
        while True:  # the step that ends the prompt computes its first token
            prompt_responses, responses = gen.next()
            assert responses == []
            if any(pr.end_of_prompt for pr in prompt_responses):
                break
        first = mlxlm.first_token(gen, uid)
        assert first is not None and first.uid == uid and first.finish_reason is None
        _, responses = gen.next()  # mlx-lm hands out the same token one step later
        assert [(r.uid, r.token) for r in responses] == [(uid, first.token)]
    finally:
        gen.close()


def test_kv_used_is_the_batch_arrays_fill():
    cache = BatchKVCache([0])
    assert mlxlm.kv_used(cache) == 0
    keys = mx.zeros((1, 2, 5, 4))
    cache.update_and_fetch(keys, keys)
    assert mlxlm.kv_used(cache) == 5 and cache.keys.shape[2] >= 5
    mlxlm.set_kv_used(cache, 3)
    k, _ = cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    assert mlxlm.kv_used(cache) == 4 and k.shape[2] == 4  # the batch continues from there


def _decode(gen, params, samplers, join_at=5):
    """Each stream's ``(token, logprobs)`` as ``gen`` returns them: streams from
    ``params`` (one each, with its processors and its sampler from ``samplers``), the
    first ``join_at`` inserted at once and the rest at the fifth step, while those
    decode; the prompts and lengths are fixed by position. Closes ``gen``."""
    from gmlx.engine import sampling

    prompts = [[(5 * i + 7 * j) % 300 + 10 for j in range(6 + i)] for i in range(len(params))]
    lengths = [10, 4, 10, 7, 10, 6, 8][:len(params)]

    def insert(streams: range) -> list[int]:
        return gen.insert([prompts[i] for i in streams], max_tokens=[lengths[i] for i in streams],
                          samplers=[samplers[i] for i in streams],
                          logits_processors=[sampling.make_processors(params[i]) for i in streams])

    uids = insert(range(min(join_at, len(params))))
    out: dict[int, list] = {uid: [] for uid in uids}
    step = 0
    while any(len(out[uid]) < lengths[i] for i, uid in enumerate(uids)) or len(uids) < len(params):
        if step == 5 and len(uids) < len(params):  # the rest join while the first decode
            uids += insert(range(len(uids), len(params)))
            out.update({uid: [] for uid in uids[join_at:]})
        for r in gen.next()[1]:
            out[r.uid].append((r.token, r.logprobs))
        step += 1
    gen.close()
    for i, uid in enumerate(uids):
        assert len(out[uid]) == lengths[i]
    return [out[uid] for uid in uids]


def _mlx_lms_own(demo_model):
    from mlx_lm.generate import BatchGenerator, GenerationBatch

    eos = sorted(demo_model.tokenizer.eos_token_ids)
    gen = BatchGenerator(demo_model.model, stop_tokens=[[t] for t in eos], completion_batch_size=8,
                         prefill_batch_size=1, prefill_step_size=64)
    assert type(gen._generation_batch) is GenerationBatch
    return gen


def _ours(demo_model):
    gen = mlxlm.batch_generator(demo_model.model, sorted(demo_model.tokenizer.eos_token_ids),
                                width=8, prefill_step=64)
    assert type(gen._generation_batch).__name__ == "DecodeBatch"
    return gen


def test_the_decode_step_batches_biases_and_matches_mlx_lms_own_step(demo_model):
    """gmlx's decode batch (the streams' logit biases added in one scatter) against mlx-lm's
    ``GenerationBatch`` on the same streams: each stream's tokens and log-probabilities
    are the same, with a bias alone, a bias and a penalty, a penalty alone and nothing;
    streams leave at different steps and two more join while the others decode (the
    scatter is rebuilt as the rows change). Every stream asks for log-probabilities."""
    from gmlx.engine import sampling
    from gmlx.engine.types import SamplingParams

    eos = sorted(demo_model.tokenizer.eos_token_ids)
    never_eos = {e: -100.0 for e in eos}
    params = [SamplingParams(logit_bias={**never_eos, 11: 100.0, 12: -2.0}),
              SamplingParams(logit_bias={**never_eos, 40: 1.5}, repetition_penalty=1.5),
              SamplingParams(repetition_penalty=2.0),
              SamplingParams(),
              SamplingParams(logit_bias=never_eos)]
    params += [SamplingParams(logit_bias={**never_eos, 7: 2.0}), params[1]]  # the two that join later
    samplers = [sampling.greedy_logprobs_sampler] * len(params)
    ours = _decode(_ours(demo_model), params, samplers)
    theirs = _decode(_mlx_lms_own(demo_model), params, samplers)
    for stream, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert [t for t, _ in a] == [t for t, _ in b], stream
        for (_, la), (_, lb) in zip(a, b, strict=True):
            assert mx.allclose(la, lb, atol=1e-5).item(), stream
        if stream == 0:  # the biases took hold
            assert [t for t, _ in a] == [11] * 10
        if params[stream].logit_bias:
            assert not {t for t, _ in a} & set(eos)


GREEDY_STREAMS = 6  # four at once, two joining; a bias on one, a penalty on another


def _greedy_params():
    from gmlx.engine.types import SamplingParams

    return [SamplingParams(), SamplingParams(logit_bias={7: 2.0}), SamplingParams(),
            SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams()]


def test_an_all_greedy_step_computes_no_log_probabilities(demo_model):
    """Greedy streams none of which asks for log-probabilities: the decode step takes
    the argmax of the logits, so each token is the one mlx-lm's step (which normalizes
    first) picks, and no row holds log-probabilities but a first token's (sampled by
    mlx-lm's own step as its prompt ends)."""
    from gmlx.engine import sampling

    params = _greedy_params()
    ours_gen = _ours(demo_model)
    ours = _decode(ours_gen, params, [sampling.greedy_sampler] * GREEDY_STREAMS, join_at=4)
    theirs = _decode(_mlx_lms_own(demo_model), params, [sampling.greedy_sampler] * GREEDY_STREAMS, join_at=4)
    for stream, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert [t for t, _ in a] == [t for t, _ in b], stream
        first, *rest = [lp for _, lp in a]
        assert isinstance(first, mx.array), stream
        assert rest and all(lp is None for lp in rest), stream


def test_one_greedy_stream_asking_log_probabilities_gets_them_beside_others(demo_model):
    """Greedy streams, one of which asks for log-probabilities (``greedy_logprobs_sampler``):
    the tokens are those of the steps that compute none, and that stream's
    log-probabilities are mlx-lm's (the logits less their logsumexp) at every token.
    The others get them too while it decodes beside them, then None."""
    from gmlx.engine import sampling

    params = _greedy_params()
    plain = _decode(_ours(demo_model), params, [sampling.greedy_sampler] * GREEDY_STREAMS, join_at=4)
    samplers = [sampling.greedy_sampler] * GREEDY_STREAMS
    samplers[2] = sampling.greedy_logprobs_sampler  # 10 tokens: as long as any
    ours = _decode(_ours(demo_model), params, samplers, join_at=4)
    theirs = _decode(_mlx_lms_own(demo_model), params, samplers, join_at=4)
    for stream, (a, b, c) in enumerate(zip(ours, theirs, plain, strict=True)):
        assert [t for t, _ in a] == [t for t, _ in b] == [t for t, _ in c], stream
        for (token, la), (_, lb) in zip(a, b, strict=True):
            if la is None:
                assert stream != 2
                continue
            assert abs(mx.logsumexp(la).item()) < 1e-4 and mx.argmax(la).item() == token, stream
            assert mx.allclose(la, lb, atol=1e-5).item(), stream
    assert all(lp is not None for _, lp in ours[3])  # it decoded beside the asking stream
    assert ours[4][-1][1] is None  # this one outlived it
