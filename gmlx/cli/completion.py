"""Shell completion scripts for bash, zsh and fish, as shipped in ``completions/``.

The scripts call back into ``gmlx`` for the words to offer, so they stay right as
commands change; ``python -m gmlx.cli.completion`` rewrites the shipped copies.
"""

from __future__ import annotations

from pathlib import Path

SHELLS = {"bash": "gmlx.bash", "zsh": "_gmlx", "fish": "gmlx.fish"}
COMPLETIONS_DIR = Path(__file__).resolve().parents[2] / "completions"


def render(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name="gmlx", complete_var="_GMLX_COMPLETE", shell=shell)


def write_all(folder: Path = COMPLETIONS_DIR) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shell, name in SHELLS.items():
        path = folder / name
        path.write_text(render(shell).rstrip("\n") + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_all():
        print(p)
