"""Decoding through mlx-lm's own BatchGenerator, for tests that compare a changed model
with itself unchanged."""

from __future__ import annotations

from typing import Any

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4] * 20]


def decode_together(model: Any, stop_token: int, stream: Any = None, max_tokens: int = 24) -> dict[int, list[int]]:
    """The greedy tokens of three prompts of different lengths decoded together (a
    padded batch), each up to ``max_tokens``, by uid."""
    from gmlx.engine import mlxlm

    gen = mlxlm.batch_generator(model, [stop_token], 4, 16, stream)
    uids = gen.insert(PROMPTS, max_tokens=[max_tokens] * len(PROMPTS))
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return out
