"""Shipped shell completions are current and complete real words."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gmlx.cli.completion import COMPLETIONS_DIR, SHELLS, render


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_shipped_script_is_current(shell):
    shipped = (COMPLETIONS_DIR / SHELLS[shell]).read_text()
    assert shipped == render(shell).rstrip("\n") + "\n", "run `python -m gmlx.cli.completion`"


def test_bash_completion_offers_commands_and_options():
    def complete(words: str, cword: int) -> list[str]:
        env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(cword), "_GMLX_COMPLETE": "complete_bash"}
        out = subprocess.run([sys.executable, "-m", "gmlx.cli.main"], env=env, capture_output=True,
                             text=True, timeout=60, check=False)
        return out.stdout.split()

    assert "run" in complete("gmlx r", 1)
    assert {"serve", "top", "plan", "keep", "unload", "ps"} <= set(complete("gmlx ", 1))
    assert "--max-tokens" in complete("gmlx run demo --max", 3)
