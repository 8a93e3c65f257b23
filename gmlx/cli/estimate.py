"""``gmlx estimate``: will a prompt fit a model's memory and context window?

Against a running server (``--url``) it asks ``POST /v1/estimate``, which knows the
prompt cache, the running requests and the recent rates. Without ``--url`` and
with a MODEL (``demo``, a GGUF file, an MLX folder or a configured id) it loads the
model here and prices the prompt with the same estimate against this machine's
free memory. Exit code 0 when it fits, 1 when it does not or cannot be judged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gmlx.cli.client import DEFAULT_URL, call_server
from gmlx.cli.local import load_here
from gmlx.cli.options import ApiKeyOpt, JsonOpt

EXIT_CODES = (
    "Exit codes: 0 it fits; 1 it does not fit, cannot be judged, or the estimate failed "
    "(one sentence on stderr); 2 usage error."
)

OptionalModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Model id, `demo`, a GGUF file or an MLX folder (`MODEL@profile` picks a "
        "profile). Without --url the model is loaded here; without MODEL, the server's.",
        show_default=False,
    ),
]
ServerUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        help=f"Ask a running gmlx server (default {DEFAULT_URL} when no MODEL).",
        show_default=False,
    ),
]


# -- loading a model here -------------------------------------------------------------


def estimate_here(ref: str, body: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/estimate`` answer computed in this process, for a model loaded here:
    the body read as the chat route reads it, estimated by the same engine code."""
    from gmlx.server.openai import translate
    from gmlx.server.openai.schemas import ChatCompletionRequest

    engine, _, name = load_here(ref)
    try:
        req = translate.chat_request(ChatCompletionRequest.model_validate({**body, "model": name}))
        result = engine.estimate_sync(req).as_dict()
    finally:
        engine.registry.close()
    return {**result, "resident": None, "where": "local"}


# -- the command -------------------------------------------------------------------------


def chat_body(prompt_file: Path, max_tokens: int | None) -> dict[str, Any]:
    """The file as a chat body: a JSON chat-completions body as is, any other text as
    one user message."""
    text = prompt_file.read_text()
    body: dict[str, Any] | None = None
    if text.lstrip().startswith("{"):
        try:
            body = json.loads(text)
        except ValueError:
            body = None
    if not isinstance(body, dict) or "messages" not in body:
        body = {"messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = max_tokens
    return body


def verdict(est: dict[str, Any]) -> tuple[bool, str]:
    """Whether the estimate says the request fits, and a sentence saying why."""
    if est.get("resident") is False:
        return False, "the model is not loaded on the server, so nothing can be counted yet"
    if est.get("context_ok") is False:
        return False, f"it exceeds the context window of {est['context_limit']} tokens"
    if est.get("fits_drained") is False:
        return False, "it needs more memory than the server can ever free for it"
    if est.get("fits_drained") is None:
        return False, "the memory it needs cannot be judged"
    if est.get("fits_now") is False:
        return True, "it fits once the running requests finish"
    return True, "it fits now"


def render_table(est: dict[str, Any], title: str) -> Table:
    from gmlx.engine.capacity import human

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in est.items():
        if key == "object":
            continue
        shown = "—" if value is None else str(value)
        if key.endswith("_bytes") and isinstance(value, int):
            shown = f"{human(value)} ({value})"
        table.add_row(key, shown)
    return table


def estimate_command(
    prompt_file: Annotated[
        Path,
        typer.Option(
            "--prompt-file",
            "-f",
            exists=True,
            dir_okay=False,
            readable=True,
            help="The prompt: plain text (one user message) or a JSON chat body.",
        ),
    ],
    model: OptionalModelArg = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            "-n",
            min=1,
            help="Pin the output cap (its KV is priced too).",
            show_default=False,
        ),
    ] = None,
    url: ServerUrlOpt = None,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Estimate whether a prompt fits: its tokens, the cached part, the memory it
    needs, and the context window."""
    body = chat_body(prompt_file, max_tokens)
    if url is None and model is not None:
        est = estimate_here(model, body)
        where = "here"
    else:
        url = url or DEFAULT_URL
        est = call_server(
            "POST", url, "/v1/estimate", api_key=api_key, json={**body, "model": model or ""}
        )
        where = url
    fits, why = verdict(est)
    if as_json:
        typer.echo(json.dumps({**est, "fits": fits}))
    else:
        out = Console()
        out.print(
            render_table(est, f"estimate of {prompt_file.name} on {est.get('model')} ({where})")
        )
        colour = "green" if fits else "red"
        out.print(f"[bold {colour}]{'fits' if fits else 'does not fit'}:[/] {why}.")
    raise typer.Exit(0 if fits else 1)
