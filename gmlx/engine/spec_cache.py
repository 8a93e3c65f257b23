"""The KV-cache surgery speculative decoding needs: trimming a batched cache per row,
cutting an extracted one, joining two, and whether a model's cache allows it at all.
Shared by the verifying batch (``gmlx.engine.speculative``) and the draft model's own
cache (``gmlx.engine.drafters``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

from gmlx.engine import mlxlm
from gmlx.engine.kv_cache import QuantKVCache


def trim_rows(cache: list[Any], added: int, keep: list[int]) -> None:
    """Drop each row's last ``added - keep[i]`` positions of a batched KV cache whose
    rows all grew by ``added``: trim to the longest row kept, roll the others right by
    their shortfall into their left padding, then drop padding every row shares. A
    quantized layer (``gmlx.engine.kv_cache``) does the same to its codes itself."""
    longest = max(keep)
    shifts = [longest - k for k in keep]
    for c in cache:
        c.trim(added - longest)
    if not any(shifts):
        return
    s = mx.array(shifts)
    plain = []
    for c in cache:
        if isinstance(c, QuantKVCache):
            c.shift_rows(shifts)
            continue
        c.keys = dynamic_roll(c.keys, s[:, None], axis=2)
        c.values = dynamic_roll(c.values, s[:, None], axis=2)
        c.offset = c.offset - s
        c.left_padding = c.left_padding + s
        plain.append(c)
    if plain and (shared := min(plain[0].left_padding.tolist())) > 0:
        for c in plain:
            c.keys = c.keys[..., shared:, :]
            c.values = c.values[..., shared:, :]
            mlxlm.set_kv_used(c, mlxlm.kv_used(c) - shared)
            c.left_padding = c.left_padding - shared


def check_cache(model: Any) -> str | None:
    """Why ``model``'s KV cache cannot be verified in rounds (None: it can): rows must be
    trimmable per stream, which a plain KV cache is and a sliding window or a
    recurrent state is not."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    kinds = {type(c).__name__ for c in make_prompt_cache(model) if not isinstance(c, KVCache)}
    return f"its cache holds {', '.join(sorted(kinds))} layers, which cannot be trimmed per stream" if kinds else None


def cut(cache: list[Any], n: int) -> list[Any]:
    """A stream's extracted cache without its last ``n`` positions."""
    if n:
        for c in cache:
            c.trim(n)
            if isinstance(c, QuantKVCache):  # never reads past its size
                continue
            c.keys = c.keys[..., : c.offset, :]
            c.values = c.values[..., : c.offset, :]
    return cache


def extend(mine: list[Any], theirs: list[Any]) -> list[Any]:
    if not mine:
        return theirs
    for a, b in zip(mine, theirs, strict=True):
        a.extend(b)
    return mine
