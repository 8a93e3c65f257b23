"""``step_census.py`` counts a decode step's primitives from MLX's own graph export: exact
counts on a graph built here, and the script end to end on the demo model (real MLX on
the CPU): its table adds up to the total it prints, and the greedy token is in it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from benchmarks.gpu import step_census

ROOT = Path(__file__).resolve().parents[2]


def test_census_counts_each_primitive_of_an_unevaluated_graph() -> None:
    a, b = mx.ones((4, 8)), mx.ones((8, 6))
    mx.eval(a, b)  # (made lazily they would be counted too)
    out = ((a @ b).reshape(2, 12)[:, :5] + 1.0).T
    # (the scalar added is broadcast to the slice's shape first: a primitive of its own)
    assert step_census.census(out) == {"Matmul": 1, "Reshape": 1, "Slice": 1, "Broadcast": 1, "Add": 1,
                                       "Transpose": 1}


def test_census_names_every_fused_kernel_compiled() -> None:
    x = mx.ones((3, 3))
    mx.eval(x)
    fused = mx.compile(lambda v: mx.exp(v * 2.0 + 1.0) @ v)(x)
    counted = step_census.census(fused)
    assert counted["Compiled"] == 1 and counted["Matmul"] == 1
    assert not any(name.startswith("Compiled") and name != "Compiled" for name in counted)


def test_the_script_on_the_demo_model_adds_up() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/step_census.py"), "demo", "--widths", "1,2",
                           "--steps", "4", "--loop", "0.3"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = re.split(r"\n(?=width \d+:)", done.stdout)[1:]
    assert len(blocks) == 2
    for block, width in zip(blocks, (1, 2), strict=True):
        head = re.match(r"width (\d+): (\d+) primitives \((\d+) views\), build [\d.]+ ms, hand over [\d.]+ ms", block)
        assert head and int(head[1]) == width, block[:200]
        rows = dict(re.findall(r"^\| (\w+)(?: \(view\))? \| (\d+) \|$", block, re.MULTILINE))
        assert sum(map(int, rows.values())) == int(head[2])
        assert sum(int(n) for name, n in rows.items() if name in step_census.VIEWS) == int(head[3])
        assert rows["ArgReduce"] == "1"  # the greedy token, taken in the step
    assert re.search(r"loop: [1-9]\d* steps of 1", done.stdout)
