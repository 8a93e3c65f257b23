"""MLX's buffer cache across prefill chunks.

MLX keeps the buffers of freed arrays in a cache and hands them to the next
allocation of the same size. mlx-lm's batch generator empties that cache
(``mx.clear_cache()``) after every prefill chunk, so that a long prompt's transients
go back to the system at once. A server pays for it on every prompt: each buffer the
following steps need is allocated afresh, and on CUDA, where freeing device memory
waits for the device, the decode steps after a prefill slow down for every running
stream. On an H200 (Qwen2.5-1.5B shape, a 2k-token prompt cache hit), the hit's
first token came after 72-108 ms with the clears and 53-68 ms without them
(``benchmarks/RESULTS.md``).

A model worker gives its thread an allowance: the bytes of one prefill chunk's
transient, which the capacity model already sets aside for prefill, so the kept
buffers take nothing a plan gives to anything else. mlx-lm's generator then sees a
view of ``mlx.core`` whose ``clear_cache`` empties the cache only when it holds more
than the calling thread's allowance. Threads without one (anything that is not a
model worker) clear as before. MLX itself still frees cached buffers whenever an
allocation would pass its memory limit.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_local = threading.local()


def keep_buffers(limit_bytes: int) -> None:
    """Let mlx-lm's calls on this thread keep up to ``limit_bytes`` of MLX's buffer cache."""
    _install()
    _local.limit = max(0, int(limit_bytes))


def _clear_cache() -> None:
    limit = getattr(_local, "limit", None)
    if limit is None or mx.get_cache_memory() > limit:
        mx.clear_cache()


def _install() -> None:
    from gmlx.engine.mlxlm import route_clear_cache

    route_clear_cache(_clear_cache)
