"""Handing a forward pass over in chunks of layers on a second thread
(``gmlx.engine.handover``): the same tokens as without it, through mlx-lm's generator
and through gmlx's worker, on this CPU (MLX's CPU backend evaluates on the second
thread as the GPU's would; whether it is faster is a GPU question, see the module)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models import llama

from gmlx.engine import handover
from gmlx.engine.types import GenerateRequest, SamplingParams
from tests.engine.decoding import decode_together


def _model() -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           rope_theta=1e4, tie_word_embeddings=False)
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _generate(model: nn.Module, stream=None) -> dict[int, list[int]]:
    return decode_together(model, 255, stream)


def test_a_chunked_forward_generates_the_same_tokens_and_detaches_cleanly() -> None:
    model = _model()
    names = [k for k, _ in nn.utils.tree_flatten(model.parameters())]
    want = _generate(model)
    chunks = handover.attach(model, 2)
    try:
        assert [k for k, _ in nn.utils.tree_flatten(model.parameters())] == names  # nothing moved
        got = _generate(model, chunks.stream)
        # layers 2 and 4 of 6 hand over in every forward (the 6th is the caller's own)
        assert chunks.handed > 0 and chunks.handed % 2 == 0
    finally:
        handover.detach(model)
    assert got == want and all(len(t) == 24 for t in got.values())
    assert type(model) is llama.Model and {type(layer) for layer in model.layers} == {llama.TransformerBlock}
    assert _generate(model) == want


def test_a_forward_on_another_stream_hands_nothing_over() -> None:
    """Warm-up, the tuner or a drafter call the model on their own streams: as before."""
    model = _model()
    chunks = handover.attach(model, 1)
    try:
        logits = model(mx.array([[1, 2, 3]]))
        mx.eval(logits)
        assert chunks.handed == 0
        with mx.stream(chunks.stream):
            again = model(mx.array([[1, 2, 3]]))
        assert chunks.handed == 5  # after layers 1-5 of 6
        assert mx.array_equal(logits, again).item()
    finally:
        handover.detach(model)


def test_a_failed_hand_over_is_raised_on_the_stepping_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    chunks = handover.attach(model, 3)
    broken = RuntimeError("the device refused")

    def refuse(*arrays):
        raise broken

    try:
        monkeypatch.setattr(mx, "async_eval", refuse)  # the hand-over thread's call (MLX's own, replaced)
        with mx.stream(chunks.stream), pytest.raises(RuntimeError, match="the device refused"):
            model(mx.array([[1, 2, 3]]))
        monkeypatch.undo()
        with mx.stream(chunks.stream):  # raised once: the next forward runs
            mx.eval(model(mx.array([[1, 2, 3]])))
    finally:
        handover.detach(model)


@pytest.mark.parametrize("value,every", [(None, 0), ("0", 0), ("8", 8), ("-2", 0), ("eight", 0)])
def test_the_setting(monkeypatch: pytest.MonkeyPatch, value: str | None, every: int) -> None:
    if value is None:
        monkeypatch.delenv(handover.ENV, raising=False)
    else:
        monkeypatch.setenv(handover.ENV, value)
    assert handover.layers_per_chunk() == every


def test_the_worker_with_it_answers_as_without(demo_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several requests at once, greedy and sampled with a seed and a logit bias, through
    a worker whose generator hands every layer but the last over; the worker's close
    gives the model back as it was."""
    from gmlx.engine.worker import ModelWorker

    chat = demo_model.tokenizer.encode_chat
    requests = [GenerateRequest(tuple(chat([{"role": "user", "content": text}])), max_tokens=12, sampling=s)
                for text in ("Hello there", "What is 2 + 2?", "x")
                for s in (SamplingParams(temperature=0.0),
                          SamplingParams(temperature=0.9, seed=5, logit_bias={7: -100.0}))]

    def answers(worker) -> list[str]:
        handles = [worker.submit(r) for r in requests]
        return ["".join(e.text for e in h) for h in handles]

    plain = ModelWorker(demo_model, decode_batch=4)
    try:
        want = answers(plain)
    finally:
        plain.close()
    monkeypatch.setenv(handover.ENV, "1")
    chunked = ModelWorker(demo_model, decode_batch=4)
    try:
        got = answers(chunked)
        attached = demo_model.model.__dict__.get("_gmlx_handover")
        assert attached is not None and attached.handed > 0
    finally:
        chunked.close()
    assert got == want
    assert "_gmlx_handover" not in demo_model.model.__dict__
