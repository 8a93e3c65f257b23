"""``gmlx run``: chat with a model in the terminal, or answer one prompt."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from gmlx.cli.errors import err_console, fail
from gmlx.cli.local import load_here
from gmlx.cli.options import MaxTokensOpt, ModelArg, SeedOpt, SystemOpt, TemperatureOpt
from gmlx.cli.plan import KVBitsOpt, KVGroupOpt, kv_quant_config
from gmlx.engine.drafting import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from gmlx.engine.errors import GmlxError
from gmlx.engine.kv_quant import DEFAULT_GROUP_SIZE
from gmlx.engine.types import (
    ChatRequest,
    Event,
    FinishReason,
    ImagePart,
    Message,
    Reasoning,
    ResponseFormat,
    TextPart,
    new_request_id,
)

if TYPE_CHECKING:
    from gmlx.engine.chat import Engine, Job

EXIT_CODES = (
    "Exit codes: 0 answered, or the chat ended (/exit, Ctrl-D); 1 failed (one sentence on "
    "stderr); 2 usage error; 130 stopped with Ctrl-C while -p answered or while the model loaded."
)
HELP_LINE = ("Type a message; /image FILE attaches an image to the next one, /reset clears the "
             "conversation, /exit (or Ctrl-D) leaves. Ctrl-C stops an answer.")

# The alternatives `--logprobs` shows per token (the table prints all but the token itself).
LOGPROB_ALTERNATIVES = 5


def stream_answer(
    job: Job,
    *,
    write: Callable[[str], None],
    write_reasoning: Callable[[str], None] | None = None,
    tokens: list[Event] | None = None,
) -> tuple[str, FinishReason]:
    """Stream one started answer, writing text (and reasoning) as it arrives; events
    that carry a token are appended to ``tokens`` when given (logprobs).

    Ctrl-C cancels the request and returns what was written so far, with a
    ``cancelled`` finish; the worker frees the slot before this returns.
    """
    handle = job.handle
    parts: list[str] = []
    while True:
        # Ctrl-C can land anywhere in here, also inside the handle's iterator, which
        # then ends; a fresh iterator resumes from the same event queue.
        try:
            for event in handle:
                if event.reasoning and write_reasoning is not None:
                    write_reasoning(event.reasoning)
                if event.text:
                    parts.append(event.text)
                    write(event.text)
                if tokens is not None and event.token_ids:
                    tokens.append(event)
                if event.final:
                    return "".join(parts), event.finish_reason or FinishReason.STOP
        except KeyboardInterrupt:
            handle.cancel()  # keep draining until the worker confirms it


def print_logprobs(job: Job, tokens: list[Event]) -> None:
    """A table of each generated token, its log-probability and the top alternatives."""
    from rich.table import Table

    assert job.tokenizer is not None
    decode = job.tokenizer.decode
    table = Table("token", "logprob", "alternatives", box=None, pad_edge=False)
    for ev in tokens:
        alternatives = "  ".join(f"{decode([i])!r} {lp:.2f}" for i, lp in ev.top_logprobs[1:])
        table.add_row(repr(decode(list(ev.token_ids))), f"{ev.logprob:.3f}", alternatives)
    err_console.print(table)


def response_format(json_schema: Path | None, json_object: bool) -> ResponseFormat | None:
    """The format ``--json-schema FILE`` or ``--json`` asks for, checked now (before any
    model loads); a file that cannot be read or compiled is one clear error."""
    from gmlx.engine.errors import InvalidRequestError
    from gmlx.engine.structured import compile_format

    if json_schema is None:
        return ResponseFormat("json_object", field="--json") if json_object else None
    try:
        schema = json.loads(json_schema.read_text())
    except OSError as e:
        fail(f"Cannot read the JSON schema {json_schema}: {e.strerror or e}.")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"{json_schema} is not valid JSON: {e}.")
    fmt = ResponseFormat("json_schema", schema, field="--json-schema")
    try:
        compile_format(fmt)
    except InvalidRequestError as e:
        fail(f"{json_schema}: {e}")
    return fmt


def run_command(
    model: ModelArg,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Answer this prompt and exit; stdout is the answer alone.")] = None,
    max_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Sampling and system-prompt profile: a built-in intent (coding, chat, creative, ...) or one from the config.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0: all).")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens below this fraction of the top token's probability.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option("--repetition-penalty", min=0.0, help="Penalize tokens already in the context (> 1).")] = None,
    json_schema: Annotated[Path | None, typer.Option("--json-schema", help="Constrain answers to JSON valid against this JSON Schema file.", dir_okay=False)] = None,
    json_object: Annotated[bool, typer.Option("--json", help="Constrain answers to a JSON object.")] = False,
    logprobs: Annotated[bool, typer.Option("--logprobs", help="After each answer, print every token's log-probability and top alternatives (stderr).")] = False,
    think: Annotated[bool | None, typer.Option("--think/--no-think", help="Ask a reasoning model to think first (or not); reasoning shows dimmed on stderr.")] = None,
    thinking_budget: Annotated[int | None, typer.Option("--thinking-budget", min=0, help="Close the thinking block after this many tokens.")] = None,
    image: Annotated[list[Path] | None, typer.Option("--image", help="Attach this image file to the prompt (repeat for several); needs a vision model.", dir_okay=False)] = None,
    kv_bits: KVBitsOpt = None,
    kv_group_size: KVGroupOpt = DEFAULT_GROUP_SIZE,
    draft: Annotated[str | None, typer.Option("--draft", help="Decode speculatively with this draft model (a configured id or a path) of the same tokenizer.")] = None,
    prompt_lookup: Annotated[bool, typer.Option("--prompt-lookup", help="Decode speculatively, drafting from n-gram matches in the conversation itself (no draft model).")] = False,
    draft_tokens: Annotated[int | None, typer.Option("--draft-tokens", min=1, max=MAX_DRAFT_TOKENS, help=f"Tokens drafted per round with --draft or --prompt-lookup (default {DEFAULT_DRAFT_TOKENS}).")] = None,
) -> None:
    if prompt is not None and not prompt.strip():
        fail("The prompt given with -p is empty.")
    images = tuple(image_part(path) for path in image or ())
    fmt = response_format(json_schema, json_object)
    engine, _, name = load_here(model, top_logprobs_cap=LOGPROB_ALTERNATIVES,
                                kv_quant=kv_quant_config(kv_bits, kv_group_size),
                                drafting={"draft_model": draft, "prompt_lookup": prompt_lookup,
                                          "draft_tokens": draft_tokens} if draft or prompt_lookup else None)
    # Explicit flags win over the profile, as request fields do on the server.
    explicit = {"temperature": temperature, "seed": seed, "top_p": top_p, "top_k": top_k,
                "min_p": min_p, "repetition_penalty": repetition_penalty}
    turn = ChatRequest(
        model=name,
        profile=profile,
        response_format=fmt,
        reasoning=Reasoning(enabled=think, budget=thinking_budget),
        sampling={k: v for k, v in explicit.items() if v is not None},
        max_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=LOGPROB_ALTERNATIVES if logprobs else 0,
    )
    try:
        base = (Message.text("system", system),) if system else ()
        if prompt is not None:
            _one_shot(engine, replace(turn, messages=(*base, user_message(prompt, images))))
        else:
            _chat(engine, turn, base, images)
    finally:
        engine.registry.close()


def image_part(path: Path) -> ImagePart:
    """An image file as a message part (a ``data:`` URI; the engine checks the image)."""
    import base64
    import mimetypes

    try:
        data = path.expanduser().read_bytes()
    except OSError as e:
        fail(f"Cannot read the image {path}: {e.strerror or e}.")
    kind = mimetypes.guess_type(path.name)[0] or ""
    kind = kind if kind.startswith("image/") else "image/unknown"  # Pillow reads the real type
    return ImagePart(f"data:{kind};base64," + base64.b64encode(data).decode())


def user_message(text: str, images: tuple[ImagePart, ...] = ()) -> Message:
    """A user turn: its images first, then its text."""
    if not images:
        return Message.text("user", text)
    return Message("user", (*images, TextPart(text)))


def _reasoning_writer() -> Callable[[str], None]:
    return lambda t: err_console.print(t, end="", style="dim", markup=False, highlight=False)


def _one_shot(engine: Engine, req: ChatRequest) -> None:
    out = sys.stdout

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    job = engine.start_sync(req)
    tokens: list[Event] = []
    _, finish = stream_answer(job, write=write, write_reasoning=_reasoning_writer(), tokens=tokens)
    out.write("\n")
    out.flush()
    if req.logprobs:
        print_logprobs(job, tokens)
    if finish is FinishReason.CANCELLED:
        raise SystemExit(130)


def _chat(engine: Engine, turn: ChatRequest, base: tuple[Message, ...],
          images: tuple[ImagePart, ...] = ()) -> None:
    console = Console(highlight=False)
    console.print(f"[dim]{turn.model} · {HELP_LINE}[/]")
    history = base
    pending = images  # attached to the next message
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
        if text.startswith("/image"):
            path = text.removeprefix("/image").strip()
            if not path:
                console.print("[dim]Usage: /image FILE[/]")
                continue
            try:
                pending = (*pending, image_part(Path(path)))
            except typer.Exit:  # fail() already said why
                continue
            console.print(f"[dim]{len(pending)} image(s) attached to your next message.[/]")
            continue
        if text == "/reset":
            history = base
            console.print("[dim]Conversation cleared.[/]")
            continue
        if text.startswith("/"):
            console.print(f"[dim]Unknown command {text.split()[0]}. {HELP_LINE}[/]")
            continue
        messages = (*history, user_message(text, pending))
        tokens: list[Event] = []
        try:
            job = engine.start_sync(replace(turn, messages=messages, id=new_request_id()))
            answer, finish = stream_answer(
                job,
                write=lambda t: console.print(t, end="", markup=False, highlight=False),
                write_reasoning=lambda t: console.print(t, end="", style="dim", markup=False, highlight=False),
                tokens=tokens,
            )
        except GmlxError as e:
            console.print(f"[bold red]error:[/] {e}", markup=True)
            continue
        console.print()
        if turn.logprobs:
            print_logprobs(job, tokens)
        if finish is FinishReason.CANCELLED:
            console.print("[dim](stopped)[/]")
        elif finish is FinishReason.LENGTH:
            console.print(f"[dim](stopped at --max-tokens {turn.max_tokens})[/]")
        history = (*messages, Message.text("assistant", answer))
        pending = ()
