"""gmlx: serve local LLMs (GGUF and MLX) on MLX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gmlx.engine.tokenizer import Tokenizer

__all__ = ["__version__", "load_tokenizer"]


def load_tokenizer(path: Any) -> Tokenizer:
    """Load just the tokenizer of a GGUF file or an MLX model folder.

    The returned object has ``encode(text, add_special_tokens=True)`` and
    ``decode(ids)``; the engine uses the same object.
    """
    from gmlx.engine.loading import load_tokenizer as _load

    return _load(path)
