"""gmlx.engine sets MLX's CUDA graph-cache settings before any GPU work, and leaves a
value the user set alone (each case in a fresh interpreter: the settings are made when
the package is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gmlx.engine import MLX_CUDA_DEFAULTS

SHOW = ("import gmlx.engine, json, os; "
        f"print(json.dumps({{k: os.environ.get(k) for k in {sorted(MLX_CUDA_DEFAULTS)!r}}}))")


def environment_after_import(**preset: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in MLX_CUDA_DEFAULTS} | preset
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_graph_cache_is_larger_and_the_thrashing_fuse_off_by_default() -> None:
    assert environment_after_import() == {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000",
                                          "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


@pytest.mark.parametrize("name", sorted(MLX_CUDA_DEFAULTS))
def test_a_value_the_user_set_is_kept(name: str) -> None:
    seen = environment_after_import(**{name: "123"})
    assert seen[name] == "123"
    others = {k: v for k, v in seen.items() if k != name}
    assert others == {k: v for k, v in MLX_CUDA_DEFAULTS.items() if k != name}
