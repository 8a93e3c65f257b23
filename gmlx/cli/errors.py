"""One error map: every failure becomes one red sentence and an exit code.

Tracebacks appear only with ``GMLX_DEBUG=1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn, TypeVar

from rich.console import Console

from gmlx.engine.errors import GmlxError

T = TypeVar("T")

# Rich writes no colour or markup codes when stderr is not a terminal, and no colour
# under NO_COLOR, by itself (tests/cli/test_reference.py holds it to that); so do the
# commands' plain Console() for stdout.
err_console = Console(stderr=True, highlight=False)


def debug_enabled() -> bool:
    return os.environ.get("GMLX_DEBUG", "") not in ("", "0", "false", "no")


def _sentence(exc: BaseException) -> str:
    """Most specific first."""
    if isinstance(exc, GmlxError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"File not found: {exc.filename}."
    if isinstance(exc, PermissionError):
        return f"Permission denied: {exc.filename}."
    if isinstance(exc, MemoryError):
        return "Out of memory."
    if isinstance(exc, OSError):
        return f"System error: {exc.strerror or exc}."
    return f"Unexpected error: {type(exc).__name__}: {exc} (set GMLX_DEBUG=1 for the traceback)."


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
    raise SystemExit(code)


def run_guarded(fn: Callable[[], T]) -> T:
    """Run the CLI, turning any exception into one sentence and exit code 1."""
    try:
        return fn()
    except KeyboardInterrupt:
        err_console.print()
        raise SystemExit(130) from None
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure becomes one sentence
        if debug_enabled():
            err_console.print_exception()
        fail(_sentence(exc).replace("[", "\\["))
