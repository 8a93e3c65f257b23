"""Options shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(help="Model id, `demo`, a GGUF file or an MLX folder; `MODEL@profile` picks a profile.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate per answer.")]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", "-t", min=0.0, help="Sampling temperature (0 = greedy).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Sampling seed: the same seed and prompt give the same answer.")]
SystemOpt = Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")]
UrlOpt = Annotated[str, typer.Option("--url", help="Base URL of a running gmlx server.")]
