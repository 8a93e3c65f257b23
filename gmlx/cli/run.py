"""``gmlx run``: chat with a model in the terminal, or answer one prompt."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from gmlx.cli.errors import err_console, fail
from gmlx.cli.options import MaxTokensOpt, ModelArg, SeedOpt, SystemOpt, TemperatureOpt
from gmlx.engine.errors import GmlxError
from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from gmlx.engine.profiles import Profile
    from gmlx.engine.worker import ModelWorker

HELP_LINE = "Type a message; /reset clears the conversation, /exit (or Ctrl-D) leaves. Ctrl-C stops an answer."


def load_addressed(ref: str, profile: str | None) -> tuple[ModelWorker, Profile]:
    """Resolve ``MODEL[@profile]`` as the server does (configured ids and aliases first,
    else ``demo`` or a path) and load it; returns its worker and effective profile."""
    from gmlx.config import load_settings

    settings, (name,) = load_settings().with_models([ref])
    registry = settings.registry(decode_batch=1)
    target = registry.address(name, profile)
    with err_console.status(f"Loading {ref} …", spinner="dots"):
        worker = registry.worker(target.spec.id)
    for note in worker.loaded.notes:
        err_console.print(f"[dim]{note}[/]")
    return worker, registry.profile(target, worker.loaded)


def stream_answer(
    worker: ModelWorker,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    sampling: SamplingParams,
    write: Callable[[str], None],
) -> tuple[str, FinishReason]:
    """Generate one assistant turn, writing text as it arrives.

    Ctrl-C cancels the request and returns what was written so far, with a
    ``cancelled`` finish; the worker frees the slot before this returns.
    """
    tokens = worker.loaded.tokenizer.encode_chat(messages)
    handle = worker.submit(
        GenerateRequest(tuple(tokens), max_tokens=max_tokens, sampling=sampling)
    )
    parts: list[str] = []
    while True:
        # Ctrl-C can land anywhere in here, also inside the handle's iterator, which
        # then ends; a fresh iterator resumes from the same event queue.
        try:
            for event in handle:
                if event.text:
                    parts.append(event.text)
                    write(event.text)
                if event.final:
                    return "".join(parts), event.finish_reason or FinishReason.STOP
        except KeyboardInterrupt:
            handle.cancel()  # keep draining until the worker confirms it


def run_command(
    model: ModelArg,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Answer this prompt and exit; stdout is the answer alone.")] = None,
    max_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Sampling and system-prompt profile: a built-in intent (coding, chat, creative, ...) or one from the config.")] = None,
) -> None:
    if prompt is not None and not prompt.strip():
        fail("The prompt given with -p is empty.")
    worker, preset = load_addressed(model, profile)
    # Explicit flags win over the profile, as request fields do on the server.
    sampling = preset.sampling_params({"temperature": temperature, "seed": seed})
    system = system if system is not None else preset.system
    try:
        base = [{"role": "system", "content": system}] if system else []
        if prompt is not None:
            _one_shot(worker, [*base, {"role": "user", "content": prompt}], max_tokens, sampling)
        else:
            _chat(worker, base, max_tokens, sampling)
    finally:
        worker.close()


def _one_shot(
    worker: ModelWorker, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams
) -> None:
    out = sys.stdout

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    _, finish = stream_answer(worker, messages, max_tokens=max_tokens, sampling=sampling, write=write)
    out.write("\n")
    out.flush()
    if finish is FinishReason.CANCELLED:
        raise SystemExit(130)


def _chat(
    worker: ModelWorker, base: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams
) -> None:
    console = Console(highlight=False)
    console.print(f"[dim]{worker.loaded.id} · {HELP_LINE}[/]")
    history = list(base)
    while True:
        try:
            line = console.input("[bold green]>>> [/]")
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print("\n[dim]Use /exit or Ctrl-D to leave.[/]")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return
        if text == "/reset":
            history = list(base)
            console.print("[dim]Conversation cleared.[/]")
            continue
        if text.startswith("/"):
            console.print(f"[dim]Unknown command {text.split()[0]}. {HELP_LINE}[/]")
            continue
        turn = [*history, {"role": "user", "content": text}]
        try:
            answer, finish = stream_answer(
                worker,
                turn,
                max_tokens=max_tokens,
                sampling=sampling,
                write=lambda t: console.print(t, end="", markup=False, highlight=False),
            )
        except GmlxError as e:
            console.print(f"[bold red]error:[/] {e}", markup=True)
            continue
        console.print()
        if finish is FinishReason.CANCELLED:
            console.print("[dim](stopped)[/]")
        elif finish is FinishReason.LENGTH:
            console.print(f"[dim](stopped at --max-tokens {max_tokens})[/]")
        history = [*turn, {"role": "assistant", "content": answer}]
