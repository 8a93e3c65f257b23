"""What every model source produces: a :class:`LoadedModel`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx import nn

    from gmlx.engine.tokenizer import Tokenizer
    from gmlx.engine.vision import Vision

DEMO_ID = "demo"
DEMO_VISION_ID = "demo-vision"
DEMOS = (DEMO_ID, DEMO_VISION_ID)


@dataclass
class LoadedModel:
    """A model ready for a worker: the mlx-lm module, its tokenizer and facts about it."""

    id: str
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    source: Path
    kind: str  # "mlx", "gguf" or "demo"
    context_length: int
    notes: list[str] = field(default_factory=list)  # load-log lines (e.g. requantized tensors)
    vision: Vision | None = None  # the vision tower and projector, when they loaded
