"""gmlx.engine sets MLX's CUDA settings (graph cache, cuDNN attention, the compiled-kernel
cache's folder) before any GPU work, and leaves a value the user set alone (each case in a fresh interpreter: the settings are made when
the package is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from gmlx.engine import MLX_CUDA_DEFAULTS

NAMES = sorted([*MLX_CUDA_DEFAULTS, "MLX_PTX_CACHE_DIR"])
SHOW = ("import gmlx.engine, json, os; "
        f"print(json.dumps({{k: os.environ.get(k) for k in {NAMES!r}}}))")


def environment_after_import(**preset: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in (*NAMES, "GMLX_CACHE_DIR")} | preset
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_defaults(tmp_path: Path) -> None:
    seen = environment_after_import(GMLX_HOME=str(tmp_path))
    assert seen == {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
                    "MLX_CUDA_USE_CUDNN_SDPA": "0",
                    "MLX_PTX_CACHE_DIR": str(tmp_path / "cache" / "mlx-ptx" / version("mlx"))}


@pytest.mark.parametrize("name", NAMES)
def test_a_value_the_user_set_is_kept(name: str, tmp_path: Path) -> None:
    seen = environment_after_import(GMLX_HOME=str(tmp_path), **{name: "123"})
    assert seen[name] == "123"
    others = {k: v for k, v in seen.items() if k != name}
    assert others == {k: v for k, v in environment_after_import(GMLX_HOME=str(tmp_path)).items() if k != name}


@pytest.mark.parametrize("module", ["add_norm_cuda", "rope_cuda"])
def test_the_kernels_not_faster_yet_are_off_by_default_and_only_on_cuda(module: str, monkeypatch) -> None:
    import importlib

    kernel = importlib.import_module(f"gmlx.engine.kernels.{module}")
    monkeypatch.delenv(kernel.ENV, raising=False)
    assert not kernel.enabled()
    monkeypatch.setenv(kernel.ENV, "1")
    assert not kernel.enabled()  # this machine: MLX on the CPU
    monkeypatch.setattr(kernel.cuda_source, "available", lambda: True)  # stands in for CUDA
    assert kernel.enabled()


@pytest.mark.parametrize("module", ["glu_cuda", "qkv_cuda"])
def test_the_step_kernels_are_tuned_on_cuda_unless_turned_off(module: str, monkeypatch) -> None:
    """On CUDA the load decides where they run (``tune``); ``0`` turns them off; never on
    the CPU."""
    import importlib

    kernel = importlib.import_module(f"gmlx.engine.kernels.{module}")
    monkeypatch.delenv(kernel.ENV, raising=False)
    assert not kernel.enabled()  # this machine: MLX on the CPU
    monkeypatch.setattr(kernel.cuda_source, "available", lambda: True)  # stands in for CUDA
    assert kernel.enabled()
    monkeypatch.setenv(kernel.ENV, "0")
    assert not kernel.enabled()
