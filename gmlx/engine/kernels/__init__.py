"""Custom kernels, each used only where it is built and where it measured faster."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def prepare_layers(model: Any) -> list[str]:
    """``model``'s layers as the engine runs them: with ``GMLX_FUSE_PROJECTIONS=1``,
    projections that read one input stacked into one product (logged, not a load note: it
    changes no number a user sees), then, on CUDA, the quantized layers' paths. Returns
    the load notes."""
    from gmlx.engine.kernels.fast_linear import use_fast_kernels
    from gmlx.engine.kernels.fused import fuse_projections

    if (stacked := fuse_projections(model)) is not None:
        log.info("%s", stacked)
    note = use_fast_kernels(model)
    return [] if note is None else [note]
