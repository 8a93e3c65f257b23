"""Who proposes a speculative round's drafts: a draft model, or prompt lookup.

A drafter follows the streams of one :class:`~gmlx.engine.speculative.SpeculativeBatch`
row for row: ``admit`` adds streams (their tokens in the target's KV), ``filter`` keeps
some, ``propose`` drafts for a round and ``commit`` keeps what the round accepted.
Drafts are deterministic (the draft model's argmax, a copied span), which is what the
batch's acceptance rule assumes.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from gmlx.engine import spec_cache

log = logging.getLogger("gmlx.engine")


def _no_drafts(width: int) -> mx.array:
    return mx.zeros((width, 0), dtype=mx.uint32)


class ModelDrafter:
    """Drafts with a small model of the same vocabulary, batched like the target.

    Its batched KV holds each stream's tokens but the last one in the target's KV: a
    round feeds ``[last, pending]`` and then each draft, ``K + 1`` positions, and keeps
    ``accepted + 1`` of them per row (``spec_cache.trim_rows``). A round without drafts
    feeds ``last`` alone. A joining stream's prompt is prefilled here in chunks of
    ``prefill_step`` (the prompt cache keeps only the target's KV).
    """

    def __init__(self, model: Any, prefill_step: int, vocab_limit: int | None = None) -> None:
        self.model = model
        self.prefill_step = max(1, prefill_step)
        self.vocab_limit = vocab_limit
        self.cache: list[Any] = []

    def admit(self, token_lists: list[list[int]]) -> None:
        from mlx_lm.models.cache import BatchKVCache, make_prompt_cache


        caches = []
        for tokens in token_lists:
            cache = make_prompt_cache(self.model)
            context = tokens[:-1]
            for start in range(0, len(context), self.prefill_step):
                self.model(mx.array(context[start:start + self.prefill_step])[None], cache=cache)
                mx.eval([c.state for c in cache])
            caches.append(cache)
        merged = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
        self.cache = spec_cache.extend(self.cache, merged)

    def filter(self, keep: list[int]) -> None:
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)

    def _argmax(self, logits: mx.array) -> mx.array:
        if self.vocab_limit is not None and logits.shape[-1] > self.vocab_limit:
            logits = logits[..., : self.vocab_limit]
        return mx.argmax(logits[:, -1, :], axis=-1).astype(mx.uint32)

    def propose(self, tokens: list[list[int]], last: list[int], pending: list[int],
                caps: list[int], k: int) -> tuple[mx.array, list[int]]:
        count = max(caps)
        if count == 0:  # keep up: the target's KV gains ``last``'s successor
            self.model(mx.array(last, dtype=mx.uint32)[:, None], cache=self.cache)
            return _no_drafts(len(last)), caps
        # Each draft step starts on the device as soon as it is built, so building the
        # next one (and the target's verification after them) overlaps its work instead
        # of waiting for the round's one evaluation.
        draft = self._argmax(self.model(mx.array([last, pending], dtype=mx.uint32).T, cache=self.cache))
        mx.async_eval(draft)
        drafts = [draft]
        for _ in range(count - 1):
            draft = self._argmax(self.model(draft[:, None], cache=self.cache))
            mx.async_eval(draft)
            drafts.append(draft)
        return mx.stack(drafts, axis=1), caps

    def commit(self, drafted: int, accepted: list[int]) -> None:

        spec_cache.trim_rows(self.cache, drafted + 1, [n + 1 for n in accepted])

    def state(self) -> list[Any]:
        return [c.state for c in self.cache if c.keys is not None]


class _Ngrams:
    """One stream's n-grams: for each, the index just past its latest occurrence."""

    def __init__(self) -> None:
        self.after: dict[tuple[int, ...], int] = {}
        self.done = 0  # positions of the stream's tokens indexed so far

    def draft(self, seq: list[int], pending: int, cap: int, sizes: range) -> list[int]:
        """Up to ``cap`` tokens that followed the latest earlier occurrence of the
        stream's last n-gram (its tokens, then ``pending``), longest n first."""
        for end in range(self.done + 1, len(seq) + 1):  # n-grams ending before ``pending``
            for n in sizes:
                if end >= n:
                    self.after[tuple(seq[end - n:end])] = end
        self.done = len(seq)
        for n in sizes:
            if len(seq) + 1 < n:
                continue
            j = self.after.get((*seq[len(seq) - n + 1:], pending) if n > 1 else (pending,))
            if j is not None:
                follow = seq[j:j + cap]
                if len(follow) < cap:
                    follow.append(pending)
                return follow
        return []


class PromptLookup:
    """Drafts by copying: the tokens that followed the latest earlier occurrence of the
    stream's last ``max_ngram`` .. ``min_ngram`` tokens in its own prompt and output
    (strong where the output repeats its input: an agent editing code). No model."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.streams: list[_Ngrams] = []

    def admit(self, token_lists: list[list[int]]) -> None:
        self.streams.extend(_Ngrams() for _ in token_lists)

    def filter(self, keep: list[int]) -> None:
        self.streams = [self.streams[i] for i in keep]

    def propose(self, tokens: list[list[int]], last: list[int], pending: list[int],
                caps: list[int], k: int) -> tuple[mx.array, list[int]]:
        found = [s.draft(t, p, c, self.sizes) if c else []
                 for s, t, p, c in zip(self.streams, tokens, pending, caps, strict=True)]
        count = max(len(f) for f in found)
        if count == 0:
            return _no_drafts(len(found)), [0] * len(found)
        return (mx.array([f + [0] * (count - len(f)) for f in found], dtype=mx.uint32),
                [len(f) for f in found])

    def commit(self, drafted: int, accepted: list[int]) -> None:
        pass

    def state(self) -> list[Any]:
        return []


