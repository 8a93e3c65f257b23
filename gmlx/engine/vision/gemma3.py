"""Gemma 3's images: a square SigLIP input, a fixed run of tokens per image.

Gemma 3's processor writes each image as ``"\\n\\n" <start_of_image>`` then
``mm_tokens_per_image`` copies of ``<image_soft_token>`` then ``<end_of_image> "\\n\\n"``;
its chat template writes ``<start_of_image>`` where an image goes. Images are resized
to the tower's square input (no pan-and-scan crops) and normalized with the
processor's mean and deviation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.vision import Vision

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


def vision(encoder: Any, config: dict[str, Any], tokenizer: Any, source: Path) -> Vision:
    """The placement facts of a Gemma 3 model from its config (an mlx-vlm
    ``config.json``, with ``image_mean``/``image_std``/``image_size`` where its
    preprocessing says) and its tokenizer."""
    vision_config = config.get("vision_config") or {}
    tokens = int(config.get("mm_tokens_per_image")
                 or (config.get("text_config") or {}).get("mm_tokens_per_image") or 256)
    ids = {}
    for name, token, key in ((BOI, BOI, "boi_token_index"), (IMAGE, IMAGE, "image_token_index"),
                             (EOI, EOI, "eoi_token_index")):
        found = tokenizer.token_to_id(token)
        ids[name] = found if found is not None else config.get(key)
        if ids[name] is None:
            raise ModelSourceError(f"{source}: the tokenizer has no {token} token, so images "
                                   "cannot be placed in a prompt.")
    # mlx-vlm puts image features where its config's image_token_index is; a projector
    # file cannot say it, so it is the tokenizer's image token (not Gemma 3's default id).
    encoder.config.image_token_index = int(ids[IMAGE])
    return Vision(
        encoder=encoder,
        family="gemma3",
        image_size=int(config.get("image_size") or vision_config.get("image_size") or 896),
        image_mean=_triple(config.get("image_mean"), 0.5),
        image_std=_triple(config.get("image_std"), 0.5),
        tokens_per_image=tokens,
        image_token_id=int(ids[IMAGE]),
        begin_id=int(ids[BOI]),
        end_id=int(ids[EOI]),
        around=tuple(tokenizer.encode("\n\n", add_special_tokens=False)),
        source=source,
    )


def _triple(value: Any, default: float) -> tuple[float, float, float]:
    if value is None:
        return (default, default, default)
    if isinstance(value, (int, float)):
        return (float(value),) * 3  # type: ignore[return-value]
    a, b, c = (float(v) for v in value)
    return (a, b, c)
