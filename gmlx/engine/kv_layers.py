"""A model's KV caches under a KV quantization: a fresh cache per sequence (mlx-lm's,
each plain attention layer quantized where its head dimension allows) and the listing's
account of how many layers took it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gmlx.engine.kv_cache import QuantKVCache
from gmlx.engine.kv_quant import KVQuant, head_geometry

if TYPE_CHECKING:
    from gmlx.engine.loading import LoadedModel


def make_cache(loaded: LoadedModel, kvq: KVQuant | None) -> list[Any]:
    """A fresh cache for one sequence of ``loaded``'s model: mlx-lm's, with each plain
    KV layer quantized by ``kvq`` where its head dimension allows (None: mlx-lm's)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    if kvq is None or not _quantizable(loaded, kvq):
        return cache
    from mlx_lm.models.cache import KVCache

    return [QuantKVCache(kvq) if type(layer) is KVCache else layer for layer in cache]


def _quantizable(loaded: LoadedModel, kvq: KVQuant) -> bool:
    heads = head_geometry(loaded.config)
    return heads is not None and heads[1] % kvq.group_size == 0


def describe(loaded: LoadedModel, kvq: KVQuant, applied: bool = True) -> dict[str, Any]:
    """The listing's ``kv_quant`` object for a resident model. Not ``applied`` (a
    speculative model with a scheme whose cache cannot be trimmed per stream: see
    ``model_start``): every layer counts as fp16 and the verdicts say ``dropped``."""
    layers = make_cache(loaded, kvq)
    quantized = sum(isinstance(c, QuantKVCache) for c in layers) if applied else 0
    fp16 = len(layers) - quantized
    verdict = "full" if fp16 == 0 else "partial" if quantized else "dropped"
    out: dict[str, Any] = {
        "scheme": kvq.scheme,
        "bits": kvq.bits,
        "group_size": kvq.group_size,
        "start": kvq.start,
        "layers_quantized": quantized,
        "layers_fp16": fp16,
        "verdict": verdict,
        # The quantized cache merges, filters and extends like mlx-lm's batch cache:
        # a batch of any width runs it.
        "verdict_batched": verdict,
    }
    if kvq.scheme == "kvarn":
        out.update(value_bits=kvq.val_bits, tail_tokens=kvq.tail)
    return out
