"""A model loaded in this process, for the commands that run one here (``run``, and
``estimate`` / ``plan`` without ``--url``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gmlx.cli.errors import err_console

if TYPE_CHECKING:
    from gmlx.engine.chat import Engine
    from gmlx.engine.worker import ModelWorker


def load_here(ref: str, *, top_logprobs_cap: int | None = None) -> tuple[Engine, ModelWorker, str]:
    """Resolve ``MODEL[@profile]`` as the server resolves it (configured ids and aliases
    first, else ``demo`` or a path) and load it, with a spinner, into a one-model engine
    of decode width 1 (its registry measures the model and builds its capacity table);
    prints the load log dimmed on stderr. Returns the engine, the worker and the model
    string that addresses it. ``top_logprobs_cap`` as in ``compose.build_engine``."""
    from gmlx.compose import build_engine, build_registry
    from gmlx.config import load_settings

    settings, (name,) = load_settings().with_models([ref])
    registry = build_registry(settings, decode_batch=1, warmup=False)
    with err_console.status(f"Loading {ref} …", spinner="dots"):
        worker = registry.worker(registry.address(name).spec.id)
    for note in worker.loaded.notes:
        err_console.print(f"[dim]{note}[/]")
    return build_engine(settings, registry, top_logprobs_cap=top_logprobs_cap), worker, name
