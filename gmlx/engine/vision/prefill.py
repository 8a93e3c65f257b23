"""An image request's prompt, up to its last image, into a KV cache.

mlx-lm's batch generator prefills token ids; an image token's input is its image's
projected features instead of a row of the embedding table. So a request with images
is prefilled here first, from embeddings, from the longest cached prefix of its
prompt, in pieces on the worker's thread between decode steps (:class:`Staged`: the
tower, then a prefill chunk per step), so the running streams pause for one piece at
a time; then it joins the batch as a prompt-cache hit whose rest (the text after its
last image) the batch prefills as any other.

The prompt cache keys an image request by :func:`cache_key`: its tokens with each
image's run replaced by ids derived from the image's digest, so a prefix holding a
different image is never reused, and the same image in a follow-up turn is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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


@dataclass(eq=False)
class Staged:
    """An image request's prompt on its way into a KV cache, one piece per decode step:
    first its images through the tower (their embeddings), then ``chunk`` prompt tokens
    at a time up to ``end``. ``cache`` holds the KV of ``prompt[:warm]``; it is the
    request's own (``detach``ed from any cached entry it started from)."""

    prompt: list[int]
    images: tuple[PromptImage, ...]
    cache: list[Any]
    warm: int
    end: int
    embeddings: Any = None
    _tower: Iterator[Any] | None = None

    @property
    def done(self) -> bool:
        return self.warm >= self.end

    def advance(self, model: Any, vision: Vision, chunk: int) -> None:
        """One piece of the work: a piece of the tower (``Vision.tower``), else the next
        ``chunk`` tokens. The embeddings of the whole ``prompt[:end]`` are built (each
        image through the tower once) and the warm ones skipped: a cached prefix that
        ends inside an image's run still needs that image's features."""
        import mlx.core as mx

        if self.embeddings is None:
            pixels = [image.pixels for image in self.images]
            if self._tower is None:
                self._tower = vision.tower(pixels)
            if (features := next(self._tower)) is None:
                return
            self.embeddings = vision.embed(self.prompt[: self.end], pixels, features)
            mx.eval(self.embeddings)
            self._tower = None
            return
        start, stop = self.warm, min(self.end, self.warm + max(1, chunk))
        ids = mx.array([self.prompt[start:stop]], dtype=mx.int32)
        model(ids, cache=self.cache, input_embeddings=self.embeddings[:, start:stop])
        mx.eval([layer.state for layer in self.cache])
        self.warm = stop
        if self.done:
            self.embeddings = None  # the features are in the KV now


def stage(prompt: list[int], images: tuple[PromptImage, ...], cache: list[Any], warm: int,
          end: int) -> Staged:
    """The work of prefilling ``prompt[warm:end]`` into ``cache`` (a fetched prefix's,
    or a fresh one), made the request's own first."""
    detach(cache)
    return Staged(prompt, images, cache, warm, end)


def detach(cache: list[Any]) -> None:
    """Give each layer arrays of its own. A cache fetched from the prompt cache shares
    its array objects with the cached entry, and a layer writes new KV into its arrays
    in place: without this the entry would take this prompt's image."""
    import mlx.core as mx

    for layer in cache:
        for name in ("keys", "values"):
            if isinstance(a := getattr(layer, name, None), mx.array):
                setattr(layer, name, a[...])


__all__ = ["Staged", "cache_key", "detach", "images_end", "stage"]
