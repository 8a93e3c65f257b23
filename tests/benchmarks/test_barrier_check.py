"""``benchmarks/gpu/barrier_check.py``'s kernels compile for sm_90 as MLX would compile
them (MLX has no CUDA backend here, so nothing runs), each within two blocks an SM's
registers (its grid of 256 blocks must be resident all at once, or its barrier waits for
blocks that cannot start) and without spills. Skips where no ``nvcc`` is installed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.engine.kernels import emulation
from tests.engine.kernels.test_cuda_compile import _HEADER, NVCC

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))


@pytest.mark.skipif(NVCC is None, reason="no nvcc here (the CUDA toolkit) to compile the kernels with")
def test_its_kernels_compile_and_fit_two_blocks_an_sm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import barrier_check

    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    for mode in range(4):
        barrier_check.kernel(mode, 32, 4096, 4096, 2)
    types = ["float16", "uint32", "float16", "float16", "int32", "uint32", "uint32"]
    source = _HEADER + "\n".join(emulation.function(m, types, "float16", device=True) for m in made) + "}\n"
    (tmp_path / "barrier.cu").write_text(source)
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--resource-usage", "-o", str(tmp_path / "b.cubin"),
                           str(tmp_path / "barrier.cu")], check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    used = re.findall(r"(\d+) bytes spill stores.*?\n.*?Used (\d+) registers", done.stdout + done.stderr)
    assert len(used) == 4 and all(spill == "0" and int(regs) * 256 * 2 <= 65536 for spill, regs in used), used
