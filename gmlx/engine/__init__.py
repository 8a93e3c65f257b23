"""The inference engine: no HTTP, no CLI."""

from __future__ import annotations

import os

# MLX's CUDA settings, made unless the user set them; no effect on the CPU or Metal
# backends. Each is read before the GPU work it governs (a stream's first command
# encoder, the first attention, the first kernel compile), so setting them here, before
# any GPU work, is in time.
#
# MLX_CUDA_GRAPH_CACHE_SIZE, MLX_ENABLE_CACHE_THRASHING_CHECK: MLX replays each run of up
#   to 20 kernels as a CUDA graph, kept in a cache keyed by the run's topology (shapes
#   aside); a miss instantiates a graph (tens to hundreds of microseconds on the host). A
#   serving process meets many topologies (every decode width's paths, prefill chunks,
#   the cached-prefix path, the kernels the tuner tried), more than the default capacity
#   of 400, and MLX counts misses over the process's life and, past twice the capacity,
#   raises "Cache thrashing is happening" out of the next one: in a long-lived server,
#   a request failing at an arbitrary point. So a larger cache, and that fuse off.
# MLX_CUDA_USE_CUDNN_SDPA: cuDNN's fused attention builds and NVRTC-compiles a graph for
#   every new (query length, key length) pair, so nearly every prefill of a new prompt,
#   every cached-prefix hit and every speculative round pays a compile. Off, MLX's own
#   kernels run it. Measured on the H200 (Llama-3-8B shape, Q4_K_M, served): a 2k-token
#   prefix miss 1,479 -> 195 ms, its hit 1,179 -> 56 ms, width-1 TTFT 152 -> 70 ms,
#   decode 113 -> 144 tok/s; a drafter drafting for itself 0.21x -> 0.49x of plain
#   decoding (benchmarks/RESULTS.md).
MLX_CUDA_DEFAULTS = {
    "MLX_CUDA_GRAPH_CACHE_SIZE": "4000",
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    "MLX_CUDA_USE_CUDNN_SDPA": "0",
}
for _name, _value in MLX_CUDA_DEFAULTS.items():
    os.environ.setdefault(_name, _value)


def _ptx_cache_dir() -> str:
    """Where MLX's CUDA backend keeps the kernels it compiles (PTX), so a later process
    loads them instead of compiling again: under gmlx's cache, per MLX version. MLX's
    own default is the system temp dir, which a reboot may empty and another user may
    own. On the H200, ``gmlx run`` of an 8B Q4_K_M to its first token took 98.5 s with
    an empty kernel cache and 24.5 s with a warm one."""
    from gmlx.paths import cache_dir

    return str(cache_dir() / "mlx-ptx" / _mlx_version())


def _mlx_version() -> str:
    """MLX's installed version, from its ``dist-info`` folder beside the package:
    ``importlib.metadata`` would cost every command ~20 ms of imports (measured on
    ``gmlx --help``), and importing MLX more."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("mlx")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for info in Path(folder).parent.glob("mlx-*.dist-info"):
            return info.name.removeprefix("mlx-").removesuffix(".dist-info")
    return "unknown"  # a source build without metadata: one folder for all


if "MLX_PTX_CACHE_DIR" not in os.environ:
    os.environ["MLX_PTX_CACHE_DIR"] = _ptx_cache_dir()
