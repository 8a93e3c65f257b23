"""A GGUF file is accepted wherever a model is: `gmlx run model.gguf -p ...`."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from gmlx.cli.main import app


def test_run_one_shot_on_a_gguf_file(tiny_models):
    model = tiny_models["qwen2-Q4_K"]
    args = ["run", str(model.path), "-p", "hello", "-n", "6", "-t", "0"]
    result = runner_invoke(args)
    assert result.exit_code == 0, result.output
    again = subprocess.run(
        [sys.executable, "-m", "gmlx.cli.main", *args],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == result.stdout  # greedy: the same answer in-process and as a process
    assert "requantized" not in again.stdout  # load notes go to stderr, never into the answer


def test_run_reports_requantized_tensors_on_stderr(tiny_models):
    model = tiny_models["qwen2-Q6_K"]
    result = subprocess.run(
        [sys.executable, "-m", "gmlx.cli.main", "run", str(model.path), "-p", "hi", "-n", "2", "-t", "0"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Q6_K" in result.stderr


def runner_invoke(args):
    return CliRunner().invoke(app, args)
