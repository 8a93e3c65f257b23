"""The prompt cache: reuse the KV of the longest cached prefix of a new prompt.

Built on mlx-lm's ``LRUPromptCache`` (a token trie of KV caches with byte-bounded
LRU eviction). This module adds what a server reports: the tier each lookup hit,
the warm tokens it reused, and running statistics.

Tiers:
    exact   the whole prompt was cached, on its own or as the start of a longer
            cached sequence (all but its last token are reused, since generation
            needs the logits of at least one fresh token)
    block   a proper prefix was reused: an earlier turn of the same conversation,
            or a shared system prompt cut from a longer cached sequence
    miss    nothing reusable
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

_KEY = "model"  # one PromptCache per model worker, so one trie key
TIERS = ("exact", "block", "miss")


@dataclass
class CacheLookup:
    """The result of a lookup: the tier, how many prompt tokens are warm, the KV to
    start from (None on a miss) and the prompt tokens still to prefill."""

    tier: str
    warm_tokens: int
    cache: list[Any] | None
    rest: list[int]


class PromptCache:
    """A byte-bounded prefix cache for one model. ``max_bytes <= 0`` disables it.

    ``fetch`` and ``insert`` run on the model's worker thread; ``peek``, ``stats``
    and ``reset`` may run on any thread.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=self.max_bytes or 1)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self.by_tier = dict.fromkeys(TIERS, 0)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def peek(self, tokens: list[int]) -> tuple[str, int]:
        """The (tier, warm_tokens) a fetch would give now, without copying anything."""
        if not self.enabled or len(tokens) < 2:
            return "miss", 0
        with self._lock:
            _, warm, _ = self._locate(tokens)
        return _tier(tokens, warm) if warm else ("miss", 0)

    def fetch(self, tokens: list[int]) -> CacheLookup:
        """The KV for the longest cached prefix of ``tokens``.

        The KV arrays are shared with the cached entry, not copied: only each layer's
        cache object is (so trimming it leaves the entry whole). MLX arrays are values
        (writing into a slice makes a new array wherever another reference holds the
        old one), and the batch generator merges a new request's caches into fresh batch
        arrays anyway; sharing saves a copy of the whole prefix, tens of megabytes for a
        long prompt, which on an accelerator cost more than the prefill it spares.
        """
        if not self.enabled or len(tokens) < 2:
            return self._count(CacheLookup("miss", 0, None, list(tokens)))
        with self._lock:
            entry, warm, trim = self._locate(tokens)
        if entry is None:
            return self._count(CacheLookup("miss", 0, None, list(tokens)))
        cache = [copy.copy(layer) for layer in entry]
        if trim:
            trim_prompt_cache(cache, trim)
        return self._count(CacheLookup(_tier(tokens, warm)[0], warm, cache, list(tokens[warm:])))

    def _locate(self, tokens: list[int]) -> tuple[list[Any] | None, int, int]:
        """The cached entry to start ``tokens`` from, its warm tokens, and how many of
        its tokens to trim off (caller holds the lock).

        Chooses as mlx-lm's ``fetch_nearest_cache`` does: an entry that extends the
        longest common prefix (trimmed back to it) wins over a shorter cached prefix,
        where its cache can be trimmed; at least one prompt token is always left to
        compute, for the logits. The walk is our own: mlx-lm's search looks for the
        extending entry by copying a path list at every trie node, quadratic in the
        entries' length. Every chat shares its template's first tokens, so each miss
        paid that over all cached conversations (about 50 ms on the worker thread, with
        every stream waiting, for ten 2k-token entries). Any extending entry gives the
        same warm tokens, so following one branch down is enough.
        """
        node = self._lru._trie._trie.get(_KEY)
        if node is None:
            return None, 0, 0
        short = index = 0
        short_node = node
        while index < len(tokens) and (child := node.get(tokens[index])) is not None:
            node = child
            index += 1
            if "__value__" in node:
                short, short_node = index, node
        if short == len(tokens):
            entry = node["__value__"].prompt_cache
            return (entry, len(tokens) - 1, 1) if can_trim_prompt_cache(entry) else (None, 0, 0)
        short = short if short > 1 else 0  # as mlx-lm: a one-token prefix is not worth it
        if index > short:
            end, depth = node, index
            while "__value__" not in end:
                step = next((k for k in end if k != "__value__"), None)
                if step is None:
                    break
                end, depth = end[step], depth + 1
            if "__value__" in end and can_trim_prompt_cache(entry := end["__value__"].prompt_cache):
                prefix = min(len(tokens) - 1, index)
                return entry, prefix, depth - prefix
        if short:
            return short_node["__value__"].prompt_cache, short, 0
        return None, 0, 0

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        """Remember the KV of ``tokens`` (evicting least recently used entries).

        The arrays are evaluated now, in the background: a finished request's KV
        comes as lazy copies out of its batch's arrays, and an entry left unevaluated
        would keep the whole batch's arrays alive for as long as it is cached."""
        if not self.enabled or not tokens:
            return
        import mlx.core as mx
        from mlx.utils import tree_flatten

        arrays = tree_flatten([layer.state for layer in cache])
        mx.async_eval([a for _, a in arrays if isinstance(a, mx.array)])
        with self._lock:
            self._lru.insert_cache(_KEY, list(tokens), cache)

    def reset(self, stats: bool = False) -> None:
        """Drop every entry (and, with ``stats``, the counters too)."""
        with self._lock:
            self._lru.trim_to(n_sequences=0)
            if stats:
                self.hits = self.misses = self.tokens_reused = 0
                self.by_tier = dict.fromkeys(TIERS, 0)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "enabled": self.enabled,
                "hits": self.hits,
                "misses": self.misses,
                "tokens_reused": self.tokens_reused,
                "bytes": self._lru.nbytes,
                "max_bytes": self.max_bytes,
                "entries": len(self._lru),
                "tiers": dict(self.by_tier),
            }

    def _count(self, lookup: CacheLookup) -> CacheLookup:
        with self._lock:
            self.by_tier[lookup.tier] += 1
            if lookup.tier == "miss":
                self.misses += 1
            else:
                self.hits += 1
                self.tokens_reused += lookup.warm_tokens
        return lookup


def _tier(tokens: list[int], warm: int) -> tuple[str, int]:
    return ("exact" if warm >= len(tokens) - 1 else "block"), warm
