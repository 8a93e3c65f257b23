"""The prompt cache: reuse the KV of the longest cached prefix of a new prompt.

It chooses as mlx-lm's ``LRUPromptCache`` does, but finds entries through an index
of whole token blocks instead of a token-by-token trie (whose walks held the model's
worker, and every stream decoding on it, for tens of milliseconds per request on a
long agent history), counts a fetch as a use for the LRU order, and reports what a
server shows: the tier each lookup hit, the warm tokens it reused, and statistics.

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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, can_trim_prompt_cache, trim_prompt_cache

from gmlx.engine.mlxlm import kv_used, set_kv_used

TIERS = ("exact", "block", "miss")
BLOCK = 64  # tokens per step of the prefix index


@dataclass
class CacheLookup:
    """The result of a lookup: the tier, how many prompt tokens are warm, the KV to
    start from (None on a miss) and the prompt tokens still to prefill."""

    tier: str
    warm_tokens: int
    cache: list[Any] | None
    rest: list[int]


@dataclass(eq=False)
class _Entry:
    tokens: list[int]
    cache: list[Any]
    nbytes: int
    keys: list[int]  # its chained block keys
    key: tuple[int, ...] = field(init=False)  # its tokens, as the LRU order's key

    def __post_init__(self) -> None:
        self.key = tuple(self.tokens)  # once, not at every lookup, insert and eviction


class _AlignedBatchKVCache(BatchKVCache):
    """mlx-lm's batch KV cache, whose arrays only ever grow to whole ``step``s.

    mlx-lm grows a batch's arrays by whole steps past their current length, and that
    length is not always a whole number of steps (a merged history, say): its arrays
    then take lengths no other array has had. MLX reuses a freed buffer only for the
    size it held or one at most two pages smaller, so on CUDA each such length is a
    fresh device allocation, paid inside the decode steps that follow (an H200,
    Qwen2.5-1.5B shape: the three steps after a 2k-token prefix hit took 24-26 ms against
    11 ms after a miss; with whole steps, 11 ms). Growing to the next whole step keeps
    every stream's arrays at the sizes the buffer cache already holds. Its one-token
    steps carry no mask while no stream is padded (:meth:`make_mask`)."""

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        self._reserve(keys.shape[2])
        return super().update_and_fetch(keys, values)

    def _reserve(self, n: int) -> None:
        """Room for ``n`` more positions, the arrays grown to whole steps."""
        used = kv_used(self)
        need = used + n
        if self.keys is not None and need > self.keys.shape[2]:
            self.keys, self.values = (_extend_to(a, used, _whole_steps(need, self.step))
                                      for a in (self.keys, self.values))

    def write_and_attend(self, attend: Callable[[Any, Any, Any, Any], Any]) -> Any:
        """A one-token step whose keys and values ``attend(keys, values, left_padding,
        position)`` writes into this cache's arrays in place at ``position`` (an ``int32``
        array of one) as it attends (``cached_attention_cuda.attend_cached``); the cache then
        counts the position as ``update_and_fetch`` would have. The arrays stay this
        cache's own: a view another array takes of them (a finished stream's extract)
        ends before the write position, which only grows between trims."""
        self._reserve(1)
        used = kv_used(self)
        out = attend(self.keys, self.values, self.left_padding, _position(used))
        self.offset = self.offset + 1
        set_kv_used(self, used + 1)
        return out

    @property
    def left_padding(self) -> Any:
        return self._left_padding

    @left_padding.setter
    def left_padding(self, value: Any) -> None:  # every change, in place ones too, lands here
        self._left_padding, self._any_padding = value, None

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        """No mask for a decode step when no stream is padded, as mlx-lm gives a plain
        cache: with a mask array MLX's CUDA attention leaves its one-query kernel for
        its general path (several operations a layer), and the all-true mask costs its
        own. The padding is read on the host once after each change (a merge, a filter,
        a finalized prefill), not at every step."""
        if N == 1 and not return_array and not kwargs.get("window_size") and not self._padded():
            return None
        return super().make_mask(N, return_array=return_array, **kwargs)

    def _padded(self) -> bool:
        if self._any_padding is None:
            self._any_padding = any(self._left_padding.tolist())
        return self._any_padding


def batch_cache(model: Any, rows: int) -> list[Any] | None:
    """The cache a decode batch of ``rows`` streams holds in the worker's generator,
    empty, for a model whose every layer is a plain KV cache (None otherwise): what a
    load's tuner times whole steps over, so they run as served (unmasked while no stream
    is padded, the position an array: the compiled blocks' path)."""
    from mlx_lm.models.cache import make_prompt_cache

    layers = make_prompt_cache(model)
    if not all(type(c) is KVCache for c in layers):
        return None
    return [_AlignedBatchKVCache([0] * rows) for _ in layers]


class _RoomyKVCache(KVCache):
    """A request's KV layer (cached history, or empty on a miss) that a batch merges
    into whole-step arrays with room for the ``room`` prompt tokens still to prefill.

    mlx-lm's merge makes arrays exactly as long as the longest history; the first
    prefill chunk then outgrows them, and the whole history is copied into arrays of a
    length of their own (history + 256): a second copy, and fresh allocations on CUDA
    (``_AlignedBatchKVCache``). The batch merges through its first request's layers,
    so misses carry this class too."""

    room = 0

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchKVCache:
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        batch = _AlignedBatchKVCache([longest - n for n in lengths])
        if longest == 0:  # all misses: mlx-lm allocates on the first chunk, in whole steps
            return batch
        room = max(getattr(c, "room", 0) for c in caches)
        capacity = _whole_steps(longest + max(room, 1), batch.step)
        first = next(c for c in caches if c.keys is not None)
        heads, dtype = first.keys.shape[1], first.keys.dtype
        keys = mx.zeros((len(caches), heads, capacity, first.keys.shape[3]), dtype=dtype)
        values = mx.zeros((len(caches), heads, capacity, first.values.shape[3]), dtype=dtype)
        for i, (n, c) in enumerate(zip(lengths, caches)):
            if n:
                keys[i : i + 1, :, longest - n : longest] = c.keys[..., :n, :]
                values[i : i + 1, :, longest - n : longest] = c.values[..., :n, :]
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        set_kv_used(batch, longest)
        return batch


def with_room(cache: list[Any], room: int) -> list[Any]:
    """Copies of a request's KV layers (the arrays are shared, not copied) that merge
    into a batch with room for ``room`` more prompt tokens. Only plain KV layers change
    class; the others (rotating windows, state-space layers) merge as mlx-lm does."""
    out = []
    for layer in cache:
        if type(layer) in (KVCache, _RoomyKVCache):
            roomy = _RoomyKVCache()
            roomy.keys, roomy.values, roomy.offset = layer.keys, layer.values, layer.offset
            roomy.room = room
            out.append(roomy)
        else:
            out.append(copy.copy(layer))
    return out


@lru_cache(maxsize=1)
def _position(used: int) -> Any:
    """``used`` as an ``int32`` array of one, made once a step (every layer of a step
    writes at the same position)."""
    return mx.array([used], dtype=mx.int32)


def _whole_steps(n: int, step: int) -> int:
    return -(-n // step) * step


def _extend_to(a: Any, used: int, length: int) -> Any:
    """``a``'s first ``used`` positions (axis 2) followed by zeros, ``length`` in all."""
    pad = mx.zeros((*a.shape[:2], length - used, a.shape[3]), dtype=a.dtype)
    return mx.concatenate([a[..., :used, :], pad], axis=2)


def _block_keys(tokens: list[int]) -> list[int]:
    """Key ``b`` stands for the first ``(b + 1) * BLOCK`` tokens: a hash chained over
    whole blocks, each hashed at C speed. A 30k-token history is 469 Python steps, not
    30,000: a token-by-token trie walk costs the model's worker milliseconds per
    request (tens for a long agent history), with every decoding stream waiting."""
    keys, key = [], 0
    for at in range(BLOCK, len(tokens) + 1, BLOCK):
        key = hash((key, tuple(tokens[at - BLOCK : at])))
        keys.append(key)
    return keys


def _shared(a: list[int], b: list[int], start: int, limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, known to be at least ``start``
    and at most ``limit``."""
    lo, hi = start, min(len(a), len(b), limit)
    if a[lo:hi] == b[lo:hi]:
        return hi
    while lo < hi:  # bisection on C-speed slice compares
        mid = (lo + hi + 1) // 2
        if a[start:mid] == b[start:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptCache:
    """A byte-bounded prefix cache for one model. ``max_bytes <= 0`` disables it.

    Entries are KV caches keyed by their token sequences, found through an index of
    whole ``BLOCK``-token steps and evicted least recently used first (a fetch counts
    as a use). It picks as mlx-lm's ``LRUPromptCache`` does: the cached sequence that
    shares the longest prefix with a new prompt, trimmed back to it where its cache
    can be trimmed, wins over a shorter cached prefix; at least one prompt token is
    always left to compute, for the logits; a one-token prefix is not worth reusing.
    Inserting a trimmable entry drops the cached prefixes of it (it serves them).

    ``fetch`` and ``insert`` run on the model's worker thread; ``peek``, ``stats``
    and ``reset`` may run on any thread.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # LRU first
        self._by_key: dict[int, dict[_Entry, None]] = {}  # block key -> entries holding it
        self._by_end: dict[int, dict[_Entry, None]] = {}  # last whole block's key -> entries
        self._bytes = 0
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
            _, warm, _ = self._locate(list(tokens))
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
        tokens = list(tokens)
        if not self.enabled or len(tokens) < 2:
            return self._count(CacheLookup("miss", 0, None, tokens))
        with self._lock:
            entry, warm, trim = self._locate(tokens)
            if entry is not None:
                self._entries.move_to_end(entry.key)
        if entry is None:
            return self._count(CacheLookup("miss", 0, None, tokens))
        cache = with_room(entry.cache, len(tokens) - warm)
        if trim:
            trim_prompt_cache(cache, trim)
        return self._count(CacheLookup(_tier(tokens, warm)[0], warm, cache, tokens[warm:]))

    def _locate(self, tokens: list[int]) -> tuple[_Entry | None, int, int]:
        """The entry to start ``tokens`` from, its warm tokens, and how many of its
        tokens to trim off (caller holds the lock)."""
        keys = _block_keys(tokens)
        # Keys chain, so the entries sharing b + 1 whole blocks share the first b too:
        # bisect for the deepest key any entry holds.
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in self._by_key:
                lo = mid
            else:
                hi = mid - 1
        depth = lo * BLOCK
        near = self._by_key[keys[lo - 1]] if lo else self._entries.values()
        best: _Entry | None = None
        common = 0
        for entry in near:  # they part within the next block: a deeper key would match
            n = _shared(entry.tokens, tokens, depth, depth + BLOCK)
            if n > common or (n == common and best is not None and len(entry.tokens) < len(best.tokens)):
                best, common = entry, n
        if best is not None and depth and best.tokens[:depth] != tokens[:depth]:
            best, common = None, 0  # the keys collided: another conversation, never reused
        if best is not None and common == len(tokens) and can_trim_prompt_cache(best.cache):
            return best, len(tokens) - 1, len(best.tokens) - (len(tokens) - 1)  # exact
        short = self._longest_prefix(tokens, keys)
        short_len = len(short.tokens) if short is not None and len(short.tokens) > 1 else 0
        if best is not None and common > short_len and common < len(tokens) and can_trim_prompt_cache(best.cache):
            return best, common, len(best.tokens) - common
        if short_len:
            return short, short_len, 0  # type: ignore[return-value]
        return None, 0, 0

    def _longest_prefix(self, tokens: list[int], keys: list[int]) -> _Entry | None:
        """The longest cached sequence that is a proper prefix of ``tokens``."""
        for b in range(len(keys), -1, -1):
            ends = self._by_end.get(keys[b - 1] if b else 0)
            found = [e for e in ends or () if len(e.tokens) < len(tokens) and tokens[: len(e.tokens)] == e.tokens]
            if found:
                return max(found, key=lambda e: len(e.tokens))
        return None

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        """Remember the KV of ``tokens`` (evicting least recently used entries).

        The arrays are evaluated now, in the background: a finished request's KV
        comes as lazy copies out of its batch's arrays, and an entry left unevaluated
        would keep the whole batch's arrays alive for as long as it is cached."""
        if not self.enabled or not tokens:
            return
        from mlx.utils import tree_flatten

        arrays = tree_flatten([layer.state for layer in cache])
        mx.async_eval([a for _, a in arrays if isinstance(a, mx.array)])
        tokens = list(tokens)
        entry = _Entry(tokens, cache, sum(layer.nbytes for layer in cache), _block_keys(tokens))
        with self._lock:
            self._drop(self._entries.get(entry.key))
            if can_trim_prompt_cache(cache):  # it serves its prefixes: they only take room
                while (prefix := self._longest_prefix(tokens, entry.keys)) is not None:
                    self._drop(prefix)
            self._entries[entry.key] = entry
            for key in entry.keys:
                self._by_key.setdefault(key, {})[entry] = None
            self._by_end.setdefault(entry.keys[-1] if entry.keys else 0, {})[entry] = None
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: _Entry | None) -> None:
        if entry is None:
            return
        del self._entries[entry.key]
        for key in entry.keys:
            holders = self._by_key[key]
            del holders[entry]
            if not holders:
                del self._by_key[key]
        end = entry.keys[-1] if entry.keys else 0
        del self._by_end[end][entry]
        if not self._by_end[end]:
            del self._by_end[end]
        self._bytes -= entry.nbytes

    def reset(self, stats: bool = False) -> None:
        """Drop every entry (and, with ``stats``, the counters too)."""
        with self._lock:
            self._entries.clear()
            self._by_key.clear()
            self._by_end.clear()
            self._bytes = 0
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
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "entries": len(self._entries),
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
