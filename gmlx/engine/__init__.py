"""The inference engine: no HTTP, no CLI."""

from __future__ import annotations

import os

# MLX's CUDA backend replays each run of up to 20 kernels as a CUDA graph, kept in a
# cache keyed by the run's topology (shapes aside); a miss instantiates a graph (tens to
# hundreds of microseconds on the host). A serving process meets many topologies (every
# decode width's paths, prefill chunks, the cached-prefix path, the kernels the tuner
# tried), more than the default capacity of 400, and evicted graphs come back as misses.
# MLX also counts misses over the process's life and, past twice the capacity, raises
# "Cache thrashing is happening" out of the next one: in a long-lived server that is a
# request failing at an arbitrary point. So, unless the user set them: a larger cache,
# and that fuse off. Read when a stream's first command encoder is made, so before any
# GPU work; no effect on the CPU or Metal backends.
MLX_CUDA_DEFAULTS = {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
for _name, _value in MLX_CUDA_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
