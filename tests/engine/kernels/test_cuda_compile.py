"""Every custom CUDA kernel's source compiles for the H200 (sm_90) as MLX would compile
it: the signature MLX writes around the body (the inputs' CUDA types, then each
``name_shape`` / ``name_strides`` / ``name_ndim`` the body names, then the outputs),
MLX's default header reduced to what the kernels use, and the body gmlx generates.

MLX has no CUDA backend on this machine, so nothing here runs a kernel; ``nvcc``
compiling them catches what would otherwise first fail on the accelerator machine, at a
model's load. Skips where no ``nvcc`` is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from gmlx.engine.kernels import (
    add_norm_cuda,
    argmax_cuda,
    attention_cuda,
    cached_attention_cuda,
    qgemv_async,
    qgemv_cuda,
    qgemv_prepared,
    qgemv_q8,
    qkv_mixed,
    qmmw_cuda,
    rope_cuda,
)
from tests.engine.kernels import emulation

NVCC = shutil.which("nvcc") or next(
    (p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc") if os.access(p, os.X_OK)), None)

# What MLX's default header and its device utilities give a custom kernel's source.
_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
#define inf cuda::std::numeric_limits<float>::infinity()
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
namespace cg = cooperative_groups;
"""

def _wrapped(made: dict, input_types: list, output_types: list | None = None) -> str:
    """The kernel as MLX's ``build_kernel`` writes it (its outputs of the first input's
    type, unless ``output_types`` says)."""
    names = [str(t).removeprefix("mlx.core.") for t in input_types]
    outputs = [str(t).removeprefix("mlx.core.") for t in output_types] if output_types else names[0]
    return emulation.function(made, names, outputs, device=True)


# the modules whose cached kernel factories the test makes its kernels through
_MODULES = (qgemv_cuda, qkv_mixed, qmmw_cuda, attention_cuda, cached_attention_cuda, add_norm_cuda, rope_cuda,
            argmax_cuda)


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    for module in _MODULES:
        module._kernel.cache_clear()  # made again here, through the stand-in
    attention_cuda._combine_kernel.cache_clear()
    return made


@pytest.mark.skipif(NVCC is None, reason="no nvcc here (the CUDA toolkit) to compile the kernels with")
def test_every_kernel_compiles_for_sm90(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made = _capture(monkeypatch)
    kernels: list[tuple] = []  # (what was made, input types[, output types])
    try:
        for dtype in (mx.float16, mx.bfloat16):
            for bits in qgemv_cuda.BITS:
                monkeypatch.setenv(qgemv_cuda.STAGED_ENV, "1")  # the staged shapes among them
                one = qgemv_cuda.configs(1, 14336)
                for config in [*one[:2], one[6], *qgemv_cuda.STAGED, *qgemv_cuda.configs(8)[:2]]:
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, k=14336)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype]))
                for config in (one[0], qgemv_cuda.configs(8)[0]):  # a residual added as it writes
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                for config in qgemv_cuda.SPLIT:  # K split between warps, plain and with a residual
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, k=14336)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype]))
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                for config in qgemv_cuda.gated_configs(1, 4096) + qgemv_cuda.gated_configs(8):
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, gated=True, k=4096)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2]))
                for config in qgemv_cuda.gated_configs(1)[:3]:  # the norm before them folded in
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, gated=True, k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                for sizes, config in (((4096, 1024, 1024), (4, 2)), ((4096, 1024), (4, 2, 8)),
                                      ((4096, 1024, 1024), qgemv_cuda.STAGED[0])):
                    qgemv_cuda.kernel_of(dtype, bits, 64, config, parts=sizes, k=4096)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * len(sizes)]))
                for sizes in ((4096, 1024, 1024), (4096, 1024)):  # the norm before them folded in
                    qgemv_cuda.kernel_of(dtype, bits, 64, (4, 2, 1, 2), parts=sizes, k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * len(sizes), dtype]))
                split = qgemv_cuda.SPLIT[0]  # K split between warps: gated, parts, each with the norm folded in
                qgemv_cuda.kernel_of(dtype, bits, 64, split, gated=True, k=4096)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2]))
                qgemv_cuda.kernel_of(dtype, bits, 64, split, gated=True, k=4096, eps=1e-5)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                qgemv_cuda.kernel_of(dtype, bits, 64, split, parts=(4096, 1024, 1024), k=4096)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3]))
                qgemv_cuda.kernel_of(dtype, bits, 64, split, parts=(4096, 1024, 1024), k=4096, eps=1e-5)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype]))
                qgemv_cuda.kernel_of(dtype, bits, 64, (4, 4), k=4096, eps=1e-6)  # a plain one (the values)
                kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                for config in qgemv_async.ASYNC:  # streamed through shared memory: plain, residual, gated, parts
                    qgemv_cuda.kernel_of(dtype, bits, 32, config, k=14336, residual=config[0] == 4)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, *[dtype] * (config[0] == 4)]))
                qgemv_cuda.kernel_of(dtype, bits, 32, qgemv_async.ASYNC[0], gated=True, k=4096, eps=1e-5)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                qgemv_cuda.kernel_of(dtype, bits, 64, qgemv_async.ASYNC[1], parts=(4096, 1024, 1024), k=4096, eps=1e-5)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype]))
                monkeypatch.setenv(qgemv_prepared.ENV, "all")  # x prepared once a block: gated, parts, plain
                qgemv_cuda.kernel_of(dtype, bits, 32, (4, 4, 1), gated=True, k=4096, eps=1e-5)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                qgemv_cuda.kernel_of(dtype, bits, 64, (8, 1), parts=(4096, 1024, 1024), k=4096, eps=1e-5)
                kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype]))
                qgemv_cuda.kernel_of(dtype, bits, 128, (4, 2), k=8192, eps=1e-6)
                kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                assert all("_p_" in k[0]["name"] for k in kernels[-3:])
                monkeypatch.delenv(qgemv_prepared.ENV)
                if bits == 4:  # x rounded to bytes once a block: gated and parts normed, plain, residual
                    monkeypatch.setenv(qgemv_q8.ENV, "1")
                    qgemv_cuda.kernel_of(dtype, 4, 32, (4, 4, 1), gated=True, k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                    qgemv_cuda.kernel_of(dtype, 4, 64, (8, 1), parts=(4096, 1024, 1024), k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype]))
                    qgemv_cuda.kernel_of(dtype, 4, 128, (4, 2), k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                    qgemv_cuda.kernel_of(dtype, 4, 32, (4, 4), k=4096)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype]))
                    assert all("_q8_" in k[0]["name"] for k in kernels[-4:])
                    monkeypatch.setenv(qgemv_q8.ENV, "all")  # 6-bit codes too: the down product, the values
                    qgemv_cuda.kernel_of(dtype, 6, 32, (4, 4), k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                    qgemv_cuda.kernel_of(dtype, 6, 32, (8, 1), k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                    assert all("_q8_" in k[0]["name"] for k in kernels[-2:])
                    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "1")  # several chunks a lane in flight: gated, residual
                    qgemv_cuda.kernel_of(dtype, 4, 32, (4, 2, 1, 4), gated=True, k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                    qgemv_cuda.kernel_of(dtype, 6, 32, (8, 2, 1, 2), k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                    assert "_d4_q8_" in kernels[-2][0]["name"] and "_d2_q8_" in kernels[-1][0]["name"]
                    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "0")
                    # K split between warps: residual (4- and 6-bit), gated and parts with the norm folded in
                    qgemv_cuda.kernel_of(dtype, 4, 64, (16, 4, 1, 1, 0, 4), k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                    qgemv_cuda.kernel_of(dtype, 6, 32, (8, 4, 1, 1, 0, 2), k=14336, residual=True)
                    kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype, dtype]))
                    qgemv_cuda.kernel_of(dtype, 4, 32, (8, 4, 1, 1, 0, 2), gated=True, k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2, dtype]))
                    qgemv_cuda.kernel_of(dtype, 4, 32, (8, 2, 1, 1, 0, 4), parts=(4096, 1024, 1024), k=4096, eps=1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype]))
                    assert all("_q8_" in k[0]["name"] and "_s" in k[0]["name"] for k in kernels[-4:])
                    qkv_mixed._kernel(dtype, (4, 32), (6, 32), 4, 2, 1, (4096, 1024), 1024, 1e-5, 4096)  # both parts
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype], [dtype] * 3))
                    assert "_q1_q1" in kernels[-1][0]["name"]
                    monkeypatch.setenv(qgemv_q8.ENV, "0")
            for layout, values_layout in (((4, 32), (6, 32)), ((4, 64), (8, 64))):  # two layouts, one launch
                for warps, rpw, depth in ((4, 2, 1), (4, 4, 2)):
                    qkv_mixed._kernel(dtype, layout, values_layout, warps, rpw, depth, (4096, 1024), 1024, 1e-5)
                    kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 3, dtype], [dtype] * 3))
            for rows in (1, 16, 64):
                for bits in qmmw_cuda.BITS:
                    for ft, warps, unroll in qmmw_cuda.configs(rows):
                        qmmw_cuda._kernel(dtype, dtype, qmmw_cuda.row_tiles(rows), bits, 32, ft, warps, unroll)
                        kernels.append((made[-1], [dtype, mx.uint32, dtype, dtype]))
                    for ft, warps, unroll in qmmw_cuda.configs(rows, gated=True):
                        qmmw_cuda._kernel(dtype, dtype, qmmw_cuda.row_tiles(rows), bits, 32, ft, warps, unroll, True)
                        kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * 2]))
                    for sizes in ((4096, 1024, 1024), (4096, 1024)):
                        qmmw_cuda._kernel(dtype, dtype, qmmw_cuda.row_tiles(rows), bits, 32, *qmmw_cuda.configs(rows)[0],
                                          False, sizes)
                        kernels.append((made[-1], [dtype, *[mx.uint32, dtype, dtype] * len(sizes)]))
            for d in attention_cuda.HEAD_DIMS:
                attention_cuda._kernel(dtype, d, d ** -0.5)
                kernels.append((made[-1], [dtype, dtype, dtype, mx.bool_]))
                attention_cuda._kernel(dtype, d, d ** -0.5, True)
                kernels.append((made[-1], [dtype, dtype, dtype, mx.bool_], [mx.float32] * 3))
                for layout in cached_attention_cuda.LAYOUTS:
                    cached_attention_cuda._kernel(dtype, d, d ** -0.5, 4, False, layout)
                    kernels.append((made[-1], [dtype, *[dtype] * 4, mx.int32, mx.int32]))
                    cached_attention_cuda._kernel(dtype, d, d ** -0.5, 4, True, layout)  # split: float shares out
                    kernels.append((made[-1], [dtype, *[dtype] * 4, mx.int32, mx.int32], [mx.float32] * 3))
                    for pairs in cached_attention_cuda.ROPES:  # the rope folded in
                        cached_attention_cuda._kernel(dtype, d, d ** -0.5, 4, pairs == "half", layout, 1, pairs)
                        kernels.append((made[-1], [dtype, *[dtype] * 4, mx.int32, mx.int32, mx.int32, mx.float32],
                                        [mx.float32] * 3 if pairs == "half" else None))
                for layout, hsplit in (("warp", 1), (cached_attention_cuda.WIDE, 4)):  # each lane's own rope
                    for pairs in cached_attention_cuda.ROPES:
                        cached_attention_cuda._kernel(dtype, d, d ** -0.5, 4, False, layout, hsplit, pairs, 0, True, 0,
                                                      True)
                        kernels.append((made[-1], [dtype, *[dtype] * 4, mx.int32, mx.int32, mx.int32, mx.float32]))
                # the largest group each layout is built for (its shared memory within the limit)
                for layout in cached_attention_cuda.LAYOUTS:
                    group = max(g for g in range(1, 64) if cached_attention_cuda.fits(g, d, layout))
                    assert not cached_attention_cuda.fits(group + 1, d, layout)
                    if group != 4:  # made above
                        cached_attention_cuda._kernel(dtype, d, d ** -0.5, group, True, layout)
                        kernels.append((made[-1], [dtype, *[dtype] * 4, mx.int32, mx.int32], [mx.float32] * 3))
                attention_cuda._combine_kernel(dtype, d)
                kernels.append((made[-1], [mx.float32] * 3, [dtype]))
            for d in (2048, 4096):
                add_norm_cuda._kernel(dtype, d, 1e-5)
                kernels.append((made[-1], [dtype, dtype, dtype]))
            argmax_cuda._kernel(dtype)
            kernels.append((made[-1], [dtype], [mx.uint32]))
            for traditional, eps in ((False, None), (True, None), (False, 1e-6)):
                rope_cuda._kernel(dtype, 32, 8, 128, traditional, eps)
                kernels.append((made[-1], [dtype, dtype, mx.int32, mx.float32, *([dtype] * 2 if eps else [])]))
        argmax_cuda._kernel(mx.float32)
        kernels.append((made[-1], [mx.float32], [mx.uint32]))
    finally:
        for module in _MODULES:
            module._kernel.cache_clear()
        attention_cuda._combine_kernel.cache_clear()
    names = [kernel[0]["name"] for kernel in kernels]
    assert len(set(names)) == len(names)  # one name per distinct source
    source = _HEADER + "\n".join(_wrapped(*kernel) for kernel in kernels) + "} // namespace\n"
    (tmp_path / "kernels.cu").write_text(source)
    done = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "--ptx", "-o", str(tmp_path / "kernels.ptx"),
                           str(tmp_path / "kernels.cu")], check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ptx = (tmp_path / "kernels.ptx").read_text()
    assert all(re.search(rf"\.entry\s+\S*{re.escape(n)}", ptx) for n in names)
    # and assembled for the card, as the driver does at a launch: ptxas refuses a block's
    # static shared memory past 48 KB (which PTX alone does not)
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "kernels.cubin"),
                           str(tmp_path / "kernels.ptx")], check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
