"""A model loaded in this process, for the commands that run one here (``run``, and
``estimate`` / ``plan`` without ``--url``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gmlx.cli.errors import err_console

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from gmlx.config import KVQuantConfig
    from gmlx.engine.chat import Engine
    from gmlx.engine.loading.progress import LoadStatus
    from gmlx.engine.worker import ModelWorker

PHASES = {"read": "reading", "convert": "converting tensors", "cached": "reading converted weights",
          "vision": "loading the vision tower", "compile": "compiling shapes"}


@contextmanager
def load_progress(ref: str) -> Iterator[Callable[[str, LoadStatus], None]]:
    """A Rich progress bar on stderr for a model's load, one phase after the other (a
    bar where the phase counts, a spinner where it does not); yields the listener that
    moves it (``loading.progress.listening``). Gone once the block ends; nothing at all
    when stderr is not a terminal (a pipe or a log keeps only the answer and the notes)."""
    if not err_console.is_terminal:
        yield lambda model_id, status: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(f"Loading {ref}", total=None)

        def show(model_id: str, status: LoadStatus) -> None:
            bar.update(task, description=f"Loading {ref}: {PHASES.get(status.phase, status.phase)}",
                       completed=status.done, total=status.total)

        yield show



def load_here(ref: str, *, top_logprobs_cap: int | None = None,
              kv_quant: KVQuantConfig | None = None,
              drafting: dict[str, Any] | None = None) -> tuple[Engine, ModelWorker, str]:
    """Resolve ``MODEL[@profile]`` as the server resolves it (configured ids and aliases
    first, else ``demo`` or a path) and load it, with a spinner, into a one-model engine
    of decode width 1 (its registry measures the model and builds its capacity table);
    prints the load log dimmed on stderr. Returns the engine, the worker and the model
    string that addresses it. ``top_logprobs_cap`` as in ``compose.build_engine``;
    ``kv_quant`` replaces the model's configured KV quantization (``--kv-bits``);
    ``drafting`` its drafter (``Settings.with_drafting``'s keywords)."""
    from gmlx.compose import build_engine, build_registry
    from gmlx.config import load_settings
    from gmlx.engine.loading import progress

    settings, (name,) = load_settings().with_models([ref])
    if kv_quant is not None:
        settings = settings.with_kv_quant(name, kv_quant)
    if drafting:  # --draft / --prompt-lookup (``Settings.with_drafting``)
        settings = settings.with_drafting(name, **drafting)
    registry = build_registry(settings, decode_batch=1, warmup=False)
    with load_progress(ref) as show, progress.listening(show):
        worker = registry.worker(registry.address(name).spec.id)
    for note in worker.loaded.notes:
        err_console.print(f"[dim]{note}[/]")
    return build_engine(settings, registry, top_logprobs_cap=top_logprobs_cap), worker, name
