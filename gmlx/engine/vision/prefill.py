"""An image request's prompt, up to its last image, into a KV cache.

mlx-lm's batch generator prefills token ids; an image token's input is its image's
projected features instead of a row of the embedding table. So a request with images
is prefilled here first, from embeddings, on the worker's thread between two decode
steps (the running streams wait for it: one image's tower and prefill), from the
longest cached prefix of its prompt; then it joins the batch as a prompt-cache hit
whose rest (the text after its last image) the batch prefills as any other.

The prompt cache keys an image request by :func:`cache_key`: its tokens with each
image's run replaced by ids derived from the image's digest, so a prefix holding a
different image is never reused, and the same image in a follow-up turn is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from gmlx.engine.types import PromptImage
from gmlx.engine.vision import Vision

_KEY_SPACE = 1 << 62  # digest ids are negative: no tokenizer has such an id


def cache_key(vision: Vision, prompt: Sequence[int], images: Sequence[PromptImage]) -> list[int]:
    """``prompt`` with the tokens of image ``i``'s run replaced by ids drawn from its
    digest (position by position, so two images never share a run of ids)."""
    key = list(prompt)
    for (start, end), image in zip(vision.spans(prompt), images, strict=True):
        seed = int.from_bytes(hashlib.sha256(image.sha256.encode()).digest()[:8], "big")
        for offset, at in enumerate(range(start, end)):
            key[at] = -1 - (seed + offset) % _KEY_SPACE
    return key


def images_end(vision: Vision, prompt: Sequence[int]) -> int:
    """Where the prompt's last image run ends (0 when it has none)."""
    spans = vision.spans(prompt)
    return spans[-1][1] if spans else 0


def prefill(
    model: Any,
    vision: Vision,
    prompt: Sequence[int],
    images: Sequence[PromptImage],
    cache: list[Any],
    warm: int,
    end: int,
    step: int,
) -> None:
    """Fill ``cache`` (holding the KV of ``prompt[:warm]``) with ``prompt[warm:end]``,
    computed from embeddings in chunks of ``step`` tokens. The embeddings of the whole
    ``prompt[:end]`` are built (each image through the tower once), then the warm ones
    are dropped: a cached prefix that ends inside an image's run still needs that
    image's features for the rest of its run."""
    import mlx.core as mx

    _detach(cache)
    embeddings = vision.embed(prompt[:end], [image.pixels for image in images])
    ids = mx.array([list(prompt[:end])], dtype=mx.int32)
    for start in range(warm, end, step):
        stop = min(end, start + step)
        model(ids[:, start:stop], cache=cache, input_embeddings=embeddings[:, start:stop])
        mx.eval([layer.state for layer in cache])


def _detach(cache: list[Any]) -> None:
    """Give each layer arrays of its own. A cache fetched from the prompt cache shares
    its array objects with the cached entry, and a layer writes new KV into its arrays
    in place: without this the entry would take this prompt's image."""
    import mlx.core as mx

    for layer in cache:
        for name in ("keys", "values"):
            if isinstance(a := getattr(layer, name, None), mx.array):
                setattr(layer, name, a[...])


__all__ = ["cache_key", "images_end", "prefill"]
