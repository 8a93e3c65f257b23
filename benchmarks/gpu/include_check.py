"""Whether a kernel given to MLX as an ``#include`` of a file holding its source
(``GMLX_KERNEL_INCLUDE=1``, :func:`gmlx.engine.kernels.cuda_source.kernel_source`) compiles
to the same code as the kernel given whole: gmlx's one-row products at every launch shape
the 8B's layouts are tuned over (plain, gated, normed, with a residual), the in-place
attention's forms and the argmax, each compiled twice by NVRTC (the library MLX's CUDA
back-end compiles with) for sm_90, the PTX compared byte for byte.

No GPU is needed: NVRTC compiles on the host. The kernels are made by gmlx's own builders
with ``mx.fast.cuda_kernel`` recorded (this machine may have no CUDA back-end), and each
source wrapped as MLX wraps it (its default header, the signature from the kernel's
inputs and outputs, the body) with input types of the layouts' (weights ``uint32_t``,
positions and offsets ``int32_t``, the rest ``T``); MLX's own device headers stand in as
the CUDA headers they include.

    pip download --no-deps -d /tmp/nv nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-cccl   # (cu13)
    (unzip each into /tmp/nv/site)
    python benchmarks/gpu/include_check.py --nvrtc /tmp/nv/site/nvidia/cu13/lib/libnvrtc.so.13 \\
        --include /tmp/nv/site/nvidia/cu13/include
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HEADER = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda/std/limits>
#include <cuda/std/array>
#define inf cuda::std::numeric_limits<float>::infinity()
namespace mlx::core::cu {
namespace cg = cooperative_groups;
"""
INTS = {"positions", "position", "offset", "padding", "lengths", "left"}


class Nvrtc:
    def __init__(self, library: str, include: str) -> None:
        self.lib = ctypes.CDLL(library)
        self.options = [b"--gpu-architecture=compute_90", f"--include-path={include}".encode(),
                        f"--include-path={include}/cccl".encode()]  # (cuda/std: the cccl wheel's folder)

    def ptx(self, source: str) -> tuple[str | None, str]:
        lib, prog = self.lib, ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None):
            return None, "nvrtcCreateProgram failed"
        try:
            opts = (ctypes.c_char_p * len(self.options))(*self.options)
            failed = lib.nvrtcCompileProgram(prog, len(self.options), opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            if failed:
                return None, log.value.decode(errors="replace")
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, out)
            return out.value.decode(), ""
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def wrapped(kernel: dict[str, Any], source: str) -> str:
    """``source`` as MLX wraps a custom kernel's: the header, the signature, the body."""
    params = []
    for name in kernel["input_names"]:
        kind = "uint32_t" if re.fullmatch(r"w\d*", name) else "int32_t" if name in INTS else "T"
        params.append(f"const {kind}* {name}")
        for info in ("shape", "strides"):
            if f"{name}_{info}" in source:
                params.append(f"const __grid_constant__ cuda::std::array<int64_t, 8> {name}_{info}")
        if f"{name}_ndim" in source:
            params.append(f"const __grid_constant__ int {name}_ndim")
    params += [f"T* {name}" for name in kernel["output_names"]]
    return (f"{HEADER}using T = __half;\n__global__ void {kernel['name']}(\n    " + ",\n    ".join(params)
            + ") {\n" + source + "\n}\n}\n")


def recorded() -> list[dict[str, Any]]:
    """Every kernel gmlx's builders make for the 8B's layouts, as ``mx.fast.cuda_kernel``
    was called (its keywords), both with and without ``GMLX_KERNEL_INCLUDE``."""
    import mlx.core as mx

    from gmlx.engine.kernels import argmax_cuda, cached_attention_cuda, qgemv_cuda

    made: list[dict[str, Any]] = []
    mx.fast.cuda_kernel = lambda **kw: made.append(kw) or len(made)  # type: ignore[assignment]
    builders = []
    for k in (4096, 14336):
        for bits in (4, 6):
            for config in qgemv_cuda.configs(1, k):
                builders.append(lambda c=config, b=bits, k=k: qgemv_cuda.kernel_of(mx.float16, b, 32, c, k=k))
                builders.append(lambda c=config, b=bits, k=k: qgemv_cuda.kernel_of(
                    mx.float16, b, 32, c, k=k, residual=True))
            for config in qgemv_cuda.gated_configs(1, k):
                builders.append(lambda c=config, b=bits, k=k: qgemv_cuda.kernel_of(
                    mx.float16, b, 32, c, gated=True, k=k, eps=1e-5))
    for layout in ("warp", "lane"):
        for split in (False, True):
            builders.append(lambda s=split, la=layout: cached_attention_cuda._kernel(
                mx.float16, 128, 128 ** -0.5, 4, s, la))
    builders.append(lambda: argmax_cuda._kernel(mx.float16))
    pairs = []
    for build in builders:
        for include in ("0", "1"):
            os.environ["GMLX_KERNEL_INCLUDE"] = include
            for cached in (qgemv_cuda._kernel, cached_attention_cuda._kernel, argmax_cuda._kernel):
                cached.cache_clear()
            try:
                build()
            except ValueError:  # a shape this layout does not take
                made.append({})
        pairs.append((made[-2], made[-1]))
    return [p for p in pairs if p[0] and p[1]]  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvrtc", required=True, help="libnvrtc.so's path")
    p.add_argument("--include", required=True, help="a folder with cuda_fp16.h, cooperative_groups.h, cuda/std")
    args = p.parse_args()
    os.environ.setdefault("GMLX_CACHE_DIR", tempfile.mkdtemp(prefix="gmlx-include-"))
    nvrtc = Nvrtc(args.nvrtc, args.include)
    same = differ = failed = 0
    sizes = []
    seen = set()
    for whole, included in recorded():
        if whole["name"] in seen:
            continue
        seen.add(whole["name"])
        a, log_a = nvrtc.ptx(wrapped(whole, whole["source"]))
        b, log_b = nvrtc.ptx(wrapped(included, included["source"]))
        sizes.append((len(whole["source"]), len(included["source"])))
        if a is None or b is None:
            failed += 1
            print(f"{whole['name']}: not compiled ({'whole' if a is None else 'included'}): "
                  f"{(log_a or log_b).strip().splitlines()[0][:200]}")
        elif a.replace(whole["name"], "K") == b.replace(included["name"], "K"):
            same += 1
        else:
            differ += 1
            print(f"{whole['name']}: the PTX differs")
    whole_kb = sum(w for w, _ in sizes) / max(1, len(sizes)) / 1024
    incl_kb = sum(i for _, i in sizes) / max(1, len(sizes)) / 1024
    print(f"{len(sizes)} kernels: {same} the same PTX, {differ} different, {failed} not compiled; "
          f"the source MLX holds (and hashes at each evaluation) {whole_kb:.1f} KB whole, "
          f"{incl_kb:.2f} KB included, on average")
    sys.exit(1 if differ or failed else 0)


if __name__ == "__main__":
    main()
