"""A model loaded from the converted-weights cache is set up as a converted one: its
``sanitize`` runs on every load (Gemma 3's ties its output layer to the embeddings)."""

from __future__ import annotations

import mlx.core as mx

from gmlx.engine.loading import load_model


def test_a_cached_gemma3_answers_as_a_converted_one(tiny_models) -> None:
    path = tiny_models["gemma3_text-Q8_0"].path
    first, second = load_model(path), load_model(path)
    assert any("from cache" in note for note in second.notes), second.notes
    assert getattr(first.model, "tie_word_embeddings", None) == getattr(
        second.model, "tie_word_embeddings", None)
    ids = mx.array([[3, 5, 7, 11]])
    assert mx.array_equal(first.model(ids), second.model(ids))
