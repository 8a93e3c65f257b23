"""MLX model folders, as mlx-lm saves them (config.json, safetensors, tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.loading.model import LoadedModel
from gmlx.engine.tokenizer import Tokenizer

DEFAULT_CONTEXT = 4096


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"{path}/config.json cannot be read: {e}.") from e


def supported_model_types() -> list[str]:
    import mlx_lm.models

    root = Path(mlx_lm.models.__file__).parent
    skip = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "ssm"}
    return sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith("_") and p.stem not in skip)


def check_architecture(path: Path, config: dict) -> None:
    """Raise UnsupportedModelError unless mlx-lm has a model class for ``config``."""
    from gmlx.engine.mlxlm import model_classes

    try:
        model_classes(config)
    except ValueError as e:  # mlx-lm's way of saying it has no module for the type
        raise UnsupportedModelError(
            f"{path}: architecture {config.get('model_type')!r} is not supported "
            f"(supported: {', '.join(supported_model_types())})."
        ) from e


def load_tokenizer(path: Path) -> Tokenizer:
    config = _read_config(path)
    if not (path / "tokenizer.json").is_file():
        raise ModelSourceError(f"{path} has no tokenizer.json, so its tokenizer cannot be loaded.")
    eos = config.get("eos_token_id") or []
    try:
        return Tokenizer.from_dir(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    except Exception as e:  # transformers raises many types for a broken tokenizer
        raise ModelSourceError(f"The tokenizer in {path} cannot be loaded: {e}.") from e


def load(path: Path) -> LoadedModel:
    """Load an MLX model folder through mlx-lm."""
    from mlx_lm.utils import load_model

    from gmlx.engine.loading import progress

    progress.phase("read")
    config = _read_config(path)
    model_type = config.get("model_type")
    if not model_type:
        raise ModelSourceError(f"{path}/config.json has no model_type, so it is not an mlx-lm model.")
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    if not weights:
        raise ModelSourceError(f"{path} has no .safetensors weights.")
    check_architecture(path, config)
    tokenizer = load_tokenizer(path)
    try:
        model, config = load_model(path, lazy=False)
    except Exception as e:
        raise ModelSourceError(f"{path} cannot be loaded ({', '.join(weights)}): {e}.") from e
    text = config.get("text_config") or {}  # a vision model's text part
    context = int(
        config.get("max_position_embeddings")
        or text.get("max_position_embeddings")
        or config.get("max_sequence_length")
        or config.get("n_ctx")
        or DEFAULT_CONTEXT
    )
    return LoadedModel(
        id=path.name,
        model=model,
        tokenizer=tokenizer,
        config=config,
        source=path,
        kind="mlx",
        context_length=context,
    )
