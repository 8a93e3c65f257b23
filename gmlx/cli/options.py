"""Options shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(help="Model id, `demo`, a GGUF file or an MLX folder; `MODEL@profile` picks a profile.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate per answer.")]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", "-t", min=0.0, help="Sampling temperature (0 = greedy).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Sampling seed: the same seed and prompt give the same answer.")]
SystemOpt = Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")]

# Options of the commands that talk to a running server (default: client.DEFAULT_URL).
UrlOpt = Annotated[
    str, typer.Option("--url", envvar="GMLX_URL", help="Base URL of a running gmlx server.")
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="GMLX_API_KEY",
        help="The server's API key (sent as a Bearer token).",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the JSON answer for scripts instead of text.")
]
