"""What a load's tuners need to know of the compiled blocks (:mod:`compiled_blocks`)
without importing them (those sit above the tuners' modules): whether a model's blocks
run their one-token steps compiled, and how to make them (and a whole compiled step)
trace again once what their layers run has changed (a trace keeps the products' paths and kernels it met)."""

from __future__ import annotations

from typing import Any

from gmlx.engine.kernels import swaps

MARKER = "compiled_block"  # the compiled blocks' classes carry it (swaps.subclass)
PIECES = "_pieces"  # a compiled block's traced pieces, None until its next one-token step
WHOLE_MARKER = "whole_step"  # a model whose one-token step is one compiled call (whole_step)
WHOLE_TRACED = "_whole_step"  # its traced steps by (width, cache length), None until its next one-token step


def attached(model: Any) -> bool:
    """Whether any of ``model``'s blocks runs its one-token steps compiled."""
    return bool(swaps.marked(model, MARKER))


def whole(model: Any) -> bool:
    """Whether ``model``'s one-token steps are one compiled call (:mod:`whole_step`; its
    class may have been wrapped again since, by ``handover``)."""
    return any(vars(k).get(WHOLE_MARKER) for k in type(model).__mro__)


def step_form(model: Any) -> str:
    """How ``model``'s one-token steps run, for the tuners' keys: ``"whole"`` (one
    compiled call), ``"compiled"`` (compiled blocks) or ``""`` (as written)."""
    if whole(model):
        return "whole"
    return "compiled" if attached(model) else ""


def retrace(model: Any) -> None:
    """Make ``model``'s compiled blocks, and its whole compiled step where it has one
    (:mod:`whole_step`), trace again at their next one-token step."""
    for block in swaps.marked(model, MARKER):
        object.__setattr__(block, PIECES, None)
    if whole(model):
        object.__setattr__(model, WHOLE_TRACED, None)
