"""Load a model's vision part beside its text model: from an mlx-vlm model folder, or
from a llama.cpp ``mmproj`` projector file beside a GGUF language model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.loading import progress
from gmlx.engine.loading.model import LoadedModel
from gmlx.engine.media import VISION_EXTRA, vision_installed
from gmlx.engine.vision import FAMILIES, gemma3, share_text_model

log = logging.getLogger("gmlx.engine")


def declares_vision(config: dict[str, Any]) -> bool:
    """Whether a model folder's config describes a vision part."""
    return bool(config.get("vision_config"))


def from_folder(loaded: LoadedModel, path: Path) -> None:
    """Load the vision tower and projector of the mlx-vlm model folder ``path`` through
    mlx-vlm and attach them to ``loaded`` (whose text model mlx-lm loaded from the same
    folder). A folder with no vision part is left alone; one whose vision part cannot
    be served here is served as text, with a note saying why."""
    config = json.loads((path / "config.json").read_text())
    if not declares_vision(config):
        return
    family = config.get("model_type")
    if not vision_installed():
        _text_only(loaded, f"mlx-vlm is not installed ({VISION_EXTRA})")
        return
    if family not in FAMILIES:
        _text_only(loaded, f"images are not served for {family!r} models yet "
                           f"(served: {', '.join(FAMILIES)})")
        return
    from mlx_vlm.utils import load_model

    progress.phase("vision")
    try:
        encoder = load_model(path, lazy=True)
    except Exception as e:  # mlx-vlm raises many types for a folder it cannot load
        raise ModelSourceError(f"{path}: mlx-vlm cannot load its vision part: {e}.") from e
    share_text_model(encoder, loaded.model)
    _materialize(encoder)
    loaded.vision = gemma3.vision(encoder, {**config, **_preprocessing(path)},
                                  loaded.tokenizer, path)
    loaded.notes.append(loaded.vision.describe())


def from_mmproj(loaded: LoadedModel, mmproj: Path) -> None:
    """Load the llama.cpp projector file ``mmproj`` (vision tower and projector) into
    mlx-vlm's classes and attach it to ``loaded``, a GGUF language model."""
    if not vision_installed():
        raise ModelSourceError(
            f"{mmproj} is a vision projector, and serving it needs mlx-vlm ({VISION_EXTRA})."
        )
    from gmlx.engine.loading import mmproj as mmproj_file
    from gmlx.engine.vision.classes import vlm_model

    progress.phase("vision")
    projector = mmproj_file.read(mmproj, loaded.config)
    encoder = vlm_model(projector.config)
    share_text_model(encoder, loaded.model)
    try:
        encoder.load_weights(list(projector.weights.items()), strict=False)
    except ValueError as e:
        raise ModelSourceError(f"{mmproj}: its tensors do not fit the model: {e}") from e
    _materialize(encoder)
    loaded.vision = gemma3.vision(encoder, projector.config, loaded.tokenizer, mmproj)
    loaded.notes.extend([*projector.notes, loaded.vision.describe()])


def _materialize(encoder: Any) -> None:
    import mlx.core as mx

    mx.eval(encoder.vision_tower.parameters(), encoder.multi_modal_projector.parameters())
    encoder.eval()


def _preprocessing(path: Path) -> dict[str, Any]:
    """The image mean, deviation and size of a folder's ``preprocessor_config.json``."""
    try:
        pre = json.loads((path / "preprocessor_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, Any] = {k: pre[k] for k in ("image_mean", "image_std") if k in pre}
    size = pre.get("size")
    if isinstance(size, dict) and size.get("height"):
        out["image_size"] = int(size["height"])
    return out


def _text_only(loaded: LoadedModel, why: str) -> None:
    note = f"vision part not loaded: {why}; serving its text only"
    log.warning("%s: %s", loaded.id, note)
    loaded.notes.append(note)


__all__ = ["declares_vision", "from_folder", "from_mmproj"]
