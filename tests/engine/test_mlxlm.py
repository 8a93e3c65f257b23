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
