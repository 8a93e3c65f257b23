"""The one-row products' machine code for the H200 (sm_90), counted here without a GPU:
each kernel's registers a thread (ptxas) and its main loop's SASS instructions and loads,
with the loop's most common instructions. A loop's instructions a chunk, times the chunks
a multiprocessor takes, over its four issues a clock, is the least time its issue slots
allow. That is how the sums in half pairs (``GMLX_HALF2``, since removed) were found to
save nothing in machine code (the PTX counts had said ~1.9x), and what ``qgemv_prepared``
and ``qgemv_q8`` were sized by.

    python benchmarks/gpu/sass_count.py [--top 12]

Needs ``nvcc`` (the tests' ``NVCC``) and NVIDIA's ``cuobjdump`` and ``nvdisasm``: on PATH,
or ``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`` and ``--tools`` pointing at
their ``bin`` folder (``.../site-packages/nvidia/cu13/bin``). The kernels are wrapped as
MLX wraps them (``tests/engine/kernels/test_cuda_compile.py``), float16, the 8B's
normed gate-up-swiglu (4096 to 2 x 14336, 4-bit, groups of 32), its normed q-k-v and
its 4-bit down product with the residual, at the launch shapes the loads take.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gmlx.engine.kernels import qgemv_async, qgemv_cuda, qgemv_prepared, qgemv_q8
from tests.engine.kernels import test_cuda_compile as compile_test

# the variants counted: each an environment the kernels are built under
VARIANTS = {"float sums": {}, "x prepared": {qgemv_prepared.ENV: "all"},
            "x as bytes": {qgemv_q8.ENV: "all"}, "x as bytes, deep": {qgemv_q8.ENV: "all", qgemv_q8.DEEP_ENV: "1"},
            "x as bytes, split": {qgemv_q8.ENV: "all", qgemv_cuda.SPLIT_ENV: "1"}}
TWICE = ("x prepared", "x as bytes", "x as bytes, split")  # their loops are unrolled twice (``#pragma unroll 2``)
# the launch shapes counted, each variant's: the gated, the q-k-v, the down products'
SHAPES = {"x as bytes, deep": ([(4, 2, 1, 4), (4, 4, 1, 2)], [(4, 2, 1, 4), (8, 2, 1, 2)], [(4, 2, 1, 2), (8, 2, 1, 4)]),
          "x as bytes, split": ([(8, 4, 1, 1, 0, 2), (4, 4, 1, 1, 0, 4)], [(8, 2, 1, 1, 0, 4)],
                                [(8, 4, 1, 1, 0, 2), (16, 4, 1, 1, 0, 4)])}
FIRST = ([(4, 4, 1), (4, 2, 1)], [(8, 1), (4, 2)], [(4, 4)])


def kernels() -> list[tuple[str, dict, list]]:
    """(variant, what was made, input types) of each kernel counted."""
    made: list[dict] = []
    real = mx.fast.cuda_kernel
    mx.fast.cuda_kernel = lambda **kw: made.append(kw) or kw
    out = []
    dt = mx.float16
    try:
        for variant, env in VARIANTS.items():
            names = (qgemv_prepared.ENV, qgemv_q8.ENV, qgemv_q8.DEEP_ENV, qgemv_cuda.SPLIT_ENV)
            saved = {name: os.environ.get(name) for name in names}
            os.environ.update({**dict.fromkeys(names, "0"), **env})
            qgemv_cuda._kernel.cache_clear()
            gated, parts, down = SHAPES.get(variant, FIRST)
            for config in [*gated, *([qgemv_async.ASYNC[0]] if variant == "float sums" else [])]:
                qgemv_cuda.kernel_of(dt, 4, 32, config, gated=True, k=4096, eps=1e-5)
                out.append((variant, made[-1], [dt, *[mx.uint32, dt, dt] * 2, dt]))
            for config in parts:
                qgemv_cuda.kernel_of(dt, 4, 32, config, parts=(4096, 1024, 1024), k=4096, eps=1e-5)
                out.append((variant, made[-1], [dt, *[mx.uint32, dt, dt] * 3, dt]))
            if variant != "x prepared":  # (no norm before the down product)
                for config in down:
                    qgemv_cuda.kernel_of(dt, 4, 32, config, k=14336, residual=True)
                    out.append((variant, made[-1], [dt, mx.uint32, dt, dt, dt]))
                    qgemv_cuda.kernel_of(dt, 6, 32, config, k=14336, residual=True)  # the 6-bit down product
                    out.append((variant, made[-1], [dt, mx.uint32, dt, dt, dt]))
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    finally:
        mx.fast.cuda_kernel = real
        qgemv_cuda._kernel.cache_clear()
    return out


def loops(sass: str) -> dict[str, list[list[str]]]:
    """Each function's loops (the instructions from a backward branch's target to it)."""
    found = {}
    for block in sass.split("Function : ")[1:]:
        name = block.split("\n", 1)[0].strip()
        code = [(int(m.group(1), 16), m.group(2).strip())
                for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", block)]
        found[name] = []
        for at, text in code:
            m = re.search(r"BRA .*0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) < at:
                start = int(m.group(1), 16)
                found[name].append([t for a, t in code if start <= a <= at])
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", help="a folder with cuobjdump and nvdisasm, put first on PATH")
    p.add_argument("--top", type=int, default=10, help="the loop's most common instructions shown")
    args = p.parse_args()
    if args.tools:
        os.environ["PATH"] = args.tools + os.pathsep + os.environ["PATH"]
    if compile_test.NVCC is None:
        raise SystemExit("sass_count: no nvcc here (the CUDA toolkit)")
    made = kernels()
    source = compile_test._HEADER + "\n".join(compile_test._wrapped(m, types) for _, m, types in made) + "} // namespace\n"
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp, "k.cu"), Path(tmp, "k.cubin")
        cu.write_text(source)
        built = subprocess.run([compile_test.NVCC, "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o",
                                str(cubin), str(cu)], capture_output=True, text=True, check=False)
        if built.returncode:
            raise SystemExit("sass_count: nvcc failed:\n" + built.stderr[-2000:])
        try:
            dumped = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise SystemExit("sass_count: no cuobjdump on PATH (see --tools)") from None
        if "Function :" not in dumped.stdout:
            raise SystemExit("sass_count: cuobjdump gave no SASS: " + (dumped.stderr.strip() or "is nvdisasm on PATH?"))
    registers, current = {}, None
    for line in built.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            current = m.group(1)
        if (m := re.search(r"Used (\d+) registers", line)) and current:
            registers[current] = int(m.group(1))
    found = loops(dumped.stdout)
    print("| variant | kernel | registers | main loop: instructions | chunks a pass | a chunk | loads | most common |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for variant, m, _ in made:
        mangled = next(name for name in found if m["name"] in name)
        # the main loop: the longest, or the one with the byte products (x as bytes: its
        # prologue's loop, rounding x, can be the longer)
        body = max(found[mangled], key=lambda loop: (any("IDP" in t for t in loop), len(loop)), default=[])
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
        loads = sum(n for op, n in ops.items() if op.startswith(("LDG", "LDGSTS", "LDS")))
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top))
        kernel = re.sub(r"_[0-9a-f]{12}$", "", m["name"]).removeprefix("gmlx_")
        deep = re.search(r"_d(\d+)_q8", m["name"])  # a pass of the deeper loop: DEPTH chunks
        chunks = int(deep.group(1)) if deep else 2 if variant in TWICE else 1
        print(f"| {variant} | {kernel} | {registers.get(mangled, '?')} | {len(body)} | {chunks} | "
              f"{len(body) / chunks:.0f} | {loads} | {common} |")


if __name__ == "__main__":
    main()
