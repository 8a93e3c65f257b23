"""What one call of a kernel costs the host on MLX's CUDA backend, by kind: MLX's own
operations (an add, a 4-bit quantized product), a JIT custom kernel
(``mx.fast.cuda_kernel``) with and without shape arguments, and a precompiled one
(``mx.fast.precompiled_cuda_kernel`` from PTX that ``nvcc`` writes here). Each kind:
200 independent calls on tiny inputs (the GPU's work is nothing), microseconds per call
to build (Python and MLX's graph) and to evaluate (encode and launch), best of 5.

Two rows give a kernel of ~8 KB of source (as gmlx's one-row products are), whole and
through an ``#include`` of a file holding it (how gmlx gives MLX its kernels by default
since 12-08; ``GMLX_KERNEL_INCLUDE=0`` gives them whole): MLX hashes the source it holds at
every evaluation. The rows also give a view (a reshape, which launches nothing) and a kernel of 11 inputs and 3
outputs, as the step's q-k-v product is: whether a step's views and inputs, not only its
kernels, cost the host its ~10 us a kernel (12-07, H100: 165 kernels handed over in 1.70 ms).

Why: a decode step of one stream makes ~225 quantized products; a custom product that
costs the host 30 us per call where MLX's own costs 10 loses ~5 ms a step whatever its
GPU time (benchmarks/RESULTS.md, the tensor-core kernel).

    python benchmarks/gpu/call_cost.py        # on the GPU machine (nvcc for the precompiled row)
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx

PTX_SOURCE = r"""
extern "C" __global__ void gmlx_copy(const float* x, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i];
}
"""


def ptx() -> bytes | None:
    nvcc = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "k.cu", Path(d) / "k.ptx"
        src.write_text(PTX_SOURCE)
        subprocess.run([nvcc, "-ptx", "-arch=compute_80", "-o", str(out), str(src)], check=True)
        return out.read_bytes()


def cost(call, n: int = 200, reps: int = 5) -> tuple[float, float]:
    best = (float("inf"), float("inf"))
    for _ in range(reps):
        t = time.perf_counter()
        outs = [call() for _ in range(n)]
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        best = min(best, ((t2 - t) / n * 1e6, (t3 - t2) / n * 1e6), key=sum)
    return best


def main() -> None:
    x = mx.random.normal((256,))
    row = mx.random.normal((1, 256)).astype(mx.bfloat16)
    w, s, b = mx.quantize(mx.random.normal((256, 256)).astype(mx.bfloat16), group_size=32, bits=4)
    mx.eval(x, row, w, s, b)
    plain = mx.fast.cuda_kernel(name="gmlx_copy_plain", input_names=["x"], output_names=["out"],
                                source="int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 256) out[i] = x[i];")
    shaped = mx.fast.cuda_kernel(name="gmlx_copy_shaped", input_names=["x"], output_names=["out"],
                                 source="int i = blockIdx.x * blockDim.x + threadIdx.x; "
                                        "if (i < x_shape[0]) out[i] = x[i];")
    many = [mx.random.normal((256,)) for _ in range(11)]
    mx.eval(many)
    wide = mx.fast.cuda_kernel(
        name="gmlx_copy_wide", input_names=[f"x{i}" for i in range(11)], output_names=["q", "k", "v"],
        source="int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 256) { q[i] = x0[i] + x10[i]; "
               "k[i] = x1[i]; v[i] = x2[i]; }")
    # a body of ~8 KB (the size of gmlx's one-row products': MLX hashes a kernel's whole
    # source at each evaluation), given whole and through an #include of a file holding it
    # (gmlx's default form): what the hash costs a call, and whether NVRTC takes
    # the include there
    copy = "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 256) out[i] = x[i];\n"
    long_body = "".join(f"// {'filler of the kind a long kernel carries ' * 2}{n}\n" for n in range(90)) + copy
    body_dir = Path(tempfile.mkdtemp(prefix="gmlx-call-cost-"))
    (body_dir / "body.cuh").write_text(long_body)
    long_kernel = mx.fast.cuda_kernel(name="gmlx_copy_long", input_names=["x"], output_names=["out"],
                                      source=long_body)
    included = mx.fast.cuda_kernel(name="gmlx_copy_included", input_names=["x"], output_names=["out"],
                                   source=f'#include "{body_dir / "body.cuh"}"\n')

    def one(kernel):
        return lambda: kernel(inputs=[x], output_shapes=[(256,)], output_dtypes=[mx.float32], grid=(256, 1, 1),
                              threadgroup=(256, 1, 1))[0]

    kinds = {
        "a view (reshape), no kernel": lambda: x.reshape(16, 16),
        "mx.add": lambda: x + 1.0,
        "quantized_matmul 1x256x256 4-bit": lambda: mx.quantized_matmul(row, w, s, b, transpose=True,
                                                                        group_size=32, bits=4),
        "cuda_kernel": lambda: plain(inputs=[x], output_shapes=[(256,)], output_dtypes=[mx.float32],
                                     grid=(256, 1, 1), threadgroup=(256, 1, 1))[0],
        "cuda_kernel, shape argument": lambda: shaped(inputs=[x], output_shapes=[(256,)],
                                                      output_dtypes=[mx.float32], grid=(256, 1, 1),
                                                      threadgroup=(256, 1, 1))[0],
        "cuda_kernel, 11 inputs and 3 outputs (as the q-k-v product's)": lambda: wide(
            inputs=many, output_shapes=[(256,)] * 3, output_dtypes=[mx.float32] * 3, grid=(256, 1, 1),
            threadgroup=(256, 1, 1))[0],
        f"cuda_kernel, {len(long_body) / 1024:.1f} KB of source": one(long_kernel),
        "cuda_kernel, the same through an #include": one(included),
        "cuda_kernel, 9 template arguments": lambda: plain(
            inputs=[x], output_shapes=[(256,)], output_dtypes=[mx.float32], grid=(256, 1, 1),
            threadgroup=(256, 1, 1),
            template=[("T", mx.bfloat16), ("S", mx.float16), ("RT", 1), ("BITS", 4), ("G", 32), ("FT", 1),
                      ("WARPS", 8), ("U", 8), ("BF", 1)])[0],
    }
    compiled = ptx()
    if compiled is not None:
        kinds["precompiled_cuda_kernel (PTX)"] = lambda: mx.fast.precompiled_cuda_kernel(
            name="gmlx_copy", compiled_source=compiled, inputs=[x], output_shapes=[(256,)],
            output_dtypes=[mx.float32], scalars=[256], grid=(256, 1, 1), threadgroup=(256, 1, 1))[0]
    print(f"device {mx.default_device()}; 200 calls, best of 5")
    print("| kind | build us/call | evaluate us/call | all |\n|---|---:|---:|---:|")
    for name, call in kinds.items():
        try:
            mx.eval(call())
            b_us, e_us = cost(call)
            print(f"| {name} | {b_us:.1f} | {e_us:.1f} | {b_us + e_us:.1f} |", flush=True)
        except Exception as e:  # noqa: BLE001 (one kind failing keeps the others)
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:150]} | | |", flush=True)
    if compiled is None:
        print("(no nvcc: no precompiled row)")


if __name__ == "__main__":
    main()
