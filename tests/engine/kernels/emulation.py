"""CUDA's block and warp primitives on the CPU, for running a custom kernel's own source
here: each block as host threads (one after another), shared memory as the body's
static arrays, ``__syncthreads`` as a barrier of the block, a shuffle as an exchange
through memory between two barriers of the warp. Needs g++ and the CUDA toolkit's
headers (for ``__half`` and ``__nv_bfloat16`` on the host); the tests skip without."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

GXX = shutil.which("g++")
CUDA_INCLUDE = next((p for p in ("/usr/local/cuda/include",) if Path(p, "cuda_bf16.h").exists()), None)
AVAILABLE = GXX is not None and CUDA_INCLUDE is not None
WHY_NOT = "a kernel's source runs here only with g++ and the CUDA toolkit's headers"

PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
using std::max;
using std::min;
using std::isfinite;
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
static Dim gridDim;
#undef __shared__
#define __shared__ static
#undef __grid_constant__
#define __grid_constant__
using Shape = std::array<int32_t, 10>;
using Strides = std::array<int64_t, 10>;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barrier[32];
static float exchange[32][32];
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_barrier[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    exchange[warp][lane] = v;
    warp_barrier[warp]->arrive_and_wait();
    const float r = exchange[warp][lane ^ o];
    warp_barrier[warp]->arrive_and_wait();
    return r;
}
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
// an asynchronous copy to shared memory, on the host a plain one: ``valid`` bytes of ``size``
// read, the rest zero-filled
inline void gmlx_host_copy(void* dst, const void* src, int size, int valid) {
    std::memcpy(dst, src, valid);
    std::memset(static_cast<char*>(dst) + valid, 0, size - valid);
}
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    const uint64_t source = (uint64_t)a | ((uint64_t)b << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((source >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (shift & 31));
}
// four byte products summed into an integer (signed bytes), and a float rounded to the
// nearest integer, ties to even (the device's default rounding)
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline unsigned __shfl_xor_sync(unsigned m, unsigned v, int o) {  // an index through the same exchange
    return __float_as_uint(__shfl_xor_sync(m, __uint_as_float(v), o));
}
template <typename X> std::vector<X> load(const char* path, size_t n) {
    std::vector<X> data(n);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(data.data(), sizeof(X), n, f) != n) { std::perror(path); std::exit(2); }
    std::fclose(f);
    return data;
}
template <typename X> void save(const char* path, const std::vector<X>& data) {
    FILE* f = std::fopen(path, "wb");
    std::fwrite(data.data(), sizeof(X), data.size(), f);
    std::fclose(f);
}
// Runs ``body(t)`` as ``threads`` host threads for each of ``blocks`` blocks in turn.
template <typename F> void run_blocks(int blocks, int threads, F body) {
    gridDim.x = blocks; gridDim.y = gridDim.z = 1;
    for (int blk = 0; blk < blocks; ++blk) {
        std::barrier<> block(threads);
        block_barrier = &block;
        for (int w = 0; w < threads / 32; ++w) warp_barrier[w] = new std::barrier<>(32);
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
            pool.emplace_back([&, t, blk] { threadIdx.x = t; blockIdx.x = blk; body(); });
        for (auto& th : pool) th.join();
        for (int w = 0; w < threads / 32; ++w) delete warp_barrier[w];
    }
}
"""


HOST_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "uint32_t", "int32": "int32_t",
              "bool": "bool"}


def function(made: dict, input_types: list[str], output_type: str | list[str], device: bool = False) -> str:
    """A custom kernel (the keywords ``mx.fast.cuda_kernel`` was given) as MLX wraps it:
    each input, then its shape, strides and rank where the source names them, then the
    outputs. A host function ``kernel`` for the emulation, or with ``device`` the
    ``__global__`` one MLX compiles (``mlx/backend/cuda/custom_kernel.cpp``). The
    outputs are all of ``output_type``, or one type each where it is a list."""
    source = made["source"]
    constant = "const __grid_constant__" if device else "const"
    params = []
    for name, dtype in zip(made["input_names"], input_types, strict=True):
        params.append(f"const {HOST_TYPES[dtype]}* {name}")
        if f"{name}_shape" in source:
            params.append(f"{constant} Shape {name}_shape")
        if f"{name}_strides" in source:
            params.append(f"{constant} Strides {name}_strides")
        if f"{name}_ndim" in source:
            params.append(f"{constant} int {name}_ndim")
    outputs = [output_type] * len(made["output_names"]) if isinstance(output_type, str) else output_type
    params += [f"{HOST_TYPES[t]}* {name}" for name, t in zip(made["output_names"], outputs, strict=True)]
    head = f"__global__ void {made['name']}(" if device else "void kernel("
    return head + ", ".join(params) + ") {\n" + source + "\n}\n"


def made(factory: Any, *args: Any) -> list[dict]:
    """What ``factory(*args)`` (a kernel module's cached ``_kernel``) handed
    ``mx.fast.cuda_kernel`` (its source, names), made afresh through a stand-in (no CUDA
    here) and forgotten after."""
    import mlx.core as mx
    import pytest

    kernels: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: kernels.append(kw) or kw)
        factory.cache_clear()
        try:
            factory(*args)
        finally:
            factory.cache_clear()
    for kw in kernels:
        kw["source"] = included(kw["source"])
    return kernels


def included(source: str) -> str:
    """``source`` as the preprocessor hands it on: each ``#include "FILE"`` line (how MLX
    is given a kernel's source by default, :func:`cuda_source.kernel_source`) replaced by
    the file's text."""
    return re.sub(r'^#include "([^"]+)"$', lambda m: Path(m[1]).read_text(), source, flags=re.MULTILINE)


def parameters(function: str) -> list[str]:
    """The parameter names of the host function ``kernel`` (:func:`function`'s), in order."""
    head = function[function.index("(") + 1:function.index(")")]
    return [p.split()[-1].lstrip("*") for p in head.split(",")]


def compile_and_run(tmp: Path, program: str, args: list[int]) -> None:
    """Compile ``program`` (``PRELUDE``, the kernel and a ``main``) in ``tmp`` and run it
    there with ``args``; it reads and writes its arrays as files in ``tmp``."""
    import pytest

    (tmp / "kernel.cpp").write_text(program)
    done = subprocess.run([GXX, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", f"-I{CUDA_INCLUDE}",
                           "kernel.cpp", "-o", "kernel"], check=False, cwd=tmp, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    run = subprocess.run(["./kernel", *map(str, args)], check=False, cwd=tmp, capture_output=True, text=True,
                         timeout=300)
    if run.returncode != 0:
        pytest.fail(run.stderr)
