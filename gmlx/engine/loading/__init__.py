"""Model sources: turn a model reference (``demo``, a GGUF file, an MLX folder, or an
``hf:`` reference to either in the local Hugging Face cache) into a runnable
:class:`LoadedModel`.

Each source module exposes ``load(path) -> LoadedModel`` and ``load_tokenizer(path)``;
this module decides which one a reference names and wraps every failure in a
:class:`~gmlx.engine.errors.ModelSourceError` that names the path and the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.loading.model import DEMO_ID, DEMO_VISION_ID, DEMOS, LoadedModel

if TYPE_CHECKING:
    from gmlx.engine.tokenizer import Tokenizer

__all__ = ["DEMOS", "DEMO_ID", "DEMO_VISION_ID", "LoadedModel", "load_model", "load_tokenizer", "local_path", "source_kind"]


def source_kind(ref: str | Path) -> str:
    """Which source a reference names: ``demo`` (``demo`` or ``demo-vision``), ``gguf``
    or ``mlx``.

    Raises ModelSourceError when the path is missing or is not a model, or when an
    ``hf:`` reference is not in the local cache.
    """
    if str(ref) in DEMOS:
        return "demo"
    path = local_path(ref)
    if not path.exists():
        raise ModelSourceError(f"Model path {path} does not exist.")
    if path.is_file():
        if _is_gguf(path):
            return "gguf"
        raise ModelSourceError(
            f"{path} is not a model: expected a GGUF file or an MLX model folder."
        )
    if (path / "config.json").is_file():
        return "mlx"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf"
    raise ModelSourceError(
        f"{path} is not a model: the folder has no config.json"
        + (f" and {len(ggufs)} GGUF files (name one)." if ggufs else ".")
    )


def local_path(ref: str | Path) -> Path:
    """The file or folder a non-demo reference names; ``hf:`` references resolve from
    the local Hugging Face cache, never the network (ModelSourceError if absent)."""
    from gmlx.engine.loading import hf_cache

    if hf_cache.is_ref(ref):
        return hf_cache.resolve(str(ref))
    return Path(ref).expanduser()


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _gguf_file(path: Path) -> Path:
    return path if path.is_file() else min(path.glob("*.gguf"))


def load_model(ref: str | Path, *, model_id: str | None = None,
               mmproj: str | Path | None = None) -> LoadedModel:
    """Load the model a reference names, with its vision part: an mlx-vlm folder's own,
    or the llama.cpp projector file ``mmproj`` beside a GGUF. Errors are
    ModelSourceError."""
    from gmlx.engine.loading import convert_cache
    from gmlx.engine.loading import vision_part as attach

    convert_cache.keep_compiled_kernels()  # CUDA only: MLX's compiled kernels in gmlx's cache
    kind = source_kind(ref)
    if mmproj is not None and kind != "gguf":
        raise ModelSourceError(
            f"mmproj {mmproj} is for a GGUF language model, and {ref} is not one "
            "(an mlx-vlm folder carries its own vision part)."
        )
    if kind == "demo":
        from gmlx.engine.loading import demo, demo_vision

        if str(ref) == DEMO_VISION_ID:
            loaded = demo_vision.load()
            attach.from_folder(loaded, demo_vision.ensure_built())
        else:
            loaded = demo.load()
    elif kind == "gguf":
        from gmlx.engine.loading import gguf

        loaded = gguf.load(_gguf_file(local_path(ref)))
        if mmproj is not None:
            projector = local_path(mmproj)
            if not projector.is_file():
                raise ModelSourceError(f"mmproj {projector} does not exist.")
            attach.from_mmproj(loaded, projector)
    else:
        from gmlx.engine.loading import mlx_dir

        loaded = mlx_dir.load(local_path(ref))
        attach.from_folder(loaded, local_path(ref))
    if model_id:
        loaded.id = model_id
    return loaded


def load_tokenizer(ref: str | Path) -> Tokenizer:
    """Load only the tokenizer of a model reference (vocab-only GGUFs included)."""
    kind = source_kind(ref)
    if kind == "demo":
        from gmlx.engine.loading import demo, demo_vision

        return demo_vision.load_tokenizer() if str(ref) == DEMO_VISION_ID else demo.load_tokenizer()
    if kind == "gguf":
        from gmlx.engine.loading import gguf

        return gguf.load_tokenizer(_gguf_file(local_path(ref)))
    from gmlx.engine.loading import mlx_dir

    return mlx_dir.load_tokenizer(local_path(ref))
