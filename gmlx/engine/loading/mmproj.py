"""llama.cpp's mmproj format: a GGUF vision projector file read into mlx-vlm's classes.

An mmproj file holds a vision tower and the projector that maps its features into a
language model's embeddings, beside (not inside) that model's own GGUF. Its
architecture is ``clip``; ``clip.vision.*`` metadata describes the tower and
``clip.projector_type`` the projector. Gemma 3's (``gemma3``: a SigLIP tower, average
pooling, an RMS norm and one input projection) is the one supported.

Tensor names come from the Hugging Face ones through the ``gguf`` package's name map
for the ``clip`` architecture, so each mlx-vlm parameter is found by mapping its own
(Hugging Face) name the same way. The file keeps three conventions of its converter:
the projector's ``soft_emb_norm`` weight has Gemma's ``1 +`` folded in (mlx-vlm's
RMSNorm adds it at run time, so it is subtracted here), the patch embedding is a
convolution kernel in the ``[out, in, kh, kw]`` layout (MLX's is ``[out, kh, kw, in]``),
and the input projection is ``[vision_hidden, text_hidden]`` as in mlx-vlm. The tower is
small, so every tensor becomes a float array, dequantized where the file quantized it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, GGMLQuantizationType, get_tensor_name_map

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.loading import gguf_quant
from gmlx.engine.loading.gguf import check_types, model_dtype
from gmlx.engine.loading.gguf_file import GGUFFile

Q = GGMLQuantizationType
ARCHITECTURE = "clip"
PROJECTOR_TYPE = "gemma3"
# The converter writes clip.vision.projector.scale_factor only when it is not 4.
DEFAULT_SCALE = 4
DEFAULT_LAYER_NORM_EPS = 1e-6
DEFAULT_IMAGE_MEAN = (0.5, 0.5, 0.5)
DEFAULT_IMAGE_STD = (0.5, 0.5, 0.5)
PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass
class Projector:
    """A vision tower and projector read from an mmproj file.

    Args:
        config: an mlx-vlm Gemma 3 ``config.json`` for the tower, the projector and the
            text model they feed.
        weights: mlx-vlm parameters under ``vision_tower.`` and ``multi_modal_projector.``.
        notes: load-log lines.
    """

    config: dict[str, Any]
    weights: dict[str, mx.array]
    notes: list[str]


def read(path: Path, text_config: dict[str, Any]) -> Projector:
    """Read an mmproj file as mlx-vlm's Gemma 3 vision tower and projector.

    Args:
        path: the mmproj GGUF.
        text_config: the mlx-lm config of the language model the projector feeds.

    Raises ModelSourceError for a file that is not a complete vision projector for that
    model and UnsupportedModelError for a projector or tensor type gmlx cannot run.
    """
    f = GGUFFile(path)
    meta = _Metadata(path, f.metadata)
    _check_kind(path, meta)
    config = _config(path, meta, text_config)
    check_types(path, f)

    from mlx.utils import tree_flatten

    from gmlx.engine.vision.classes import vlm_model

    try:
        model = vlm_model(config)
    except Exception as e:  # config validation raises ValueError/TypeError/KeyError
        raise ModelSourceError(f"{path}: its metadata does not make a valid model: {e}.") from e
    expected = {
        prefix + name: tuple(value.shape)
        for prefix in PREFIXES
        for name, value in tree_flatten(getattr(model, prefix[:-1]).parameters())
    }

    dtype = model_dtype(f, ranks=(2, 3, 4))  # the patch embedding is a 4-D conv
    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, config["vision_config"]["num_hidden_layers"])
    weights: dict[str, mx.array] = {}
    used: set[str] = set()
    for param, shape in expected.items():
        found = names.get_type_and_name(_hf_name(param), try_suffixes=(".weight", ".bias"))
        if found is None:
            raise UnsupportedModelError(
                f"{path}: mlx-vlm's parameter {param} has no tensor name in the mmproj format."
            )
        kind, tensor = found
        info = f.tensors.get(tensor)
        if info is None:
            raise ModelSourceError(f"{path} lacks the tensor {tensor} (mlx-vlm's {param}).")
        value = gguf_quant.to_float(f.raw(tensor), info.qtype, mx.float32)
        if kind == MODEL_TENSOR.V_ENC_EMBD_PATCH and value.ndim == 4:
            value = value.transpose(0, 2, 3, 1)  # [out, in, kh, kw] -> [out, kh, kw, in]
        elif kind == MODEL_TENSOR.V_MM_SOFT_EMB_NORM:
            value = value - 1.0
        if tuple(value.shape) != shape:
            raise ModelSourceError(
                f"{path}: tensor {tensor} has shape {list(info.shape)}, which does not fit "
                f"mlx-vlm's {param} of shape {list(shape)}."
            )
        value = value.astype(dtype)
        mx.eval(value)
        weights[param] = value
        used.add(tensor)

    counts = Counter(info.qtype.name for info in f.tensors.values())
    image_size, tokens = config["vision_config"]["image_size"], config["mm_tokens_per_image"]
    notes = [
        "tensor types: " + ", ".join(f"{k} x{v}" for k, v in counts.most_common()),
        f"projector: {PROJECTOR_TYPE}, {image_size}px images as {tokens} tokens",
    ]
    if unused := sorted(set(f.tensors) - used):
        notes.append(f"ignored tensor(s) with no mlx-vlm parameter: {', '.join(unused)}")
    return Projector(config=config, weights=weights, notes=notes)


class _Metadata:
    """The file's metadata, read with its path in every error."""

    def __init__(self, path: Path, metadata: dict[str, Any]) -> None:
        self.path = path
        self.metadata = metadata

    def get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        return value.tolist() if isinstance(value, np.ndarray) else value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ModelSourceError(f"{self.path}: GGUF metadata lacks {key}.")
        if isinstance(value, list | str) or int(value) <= 0:
            raise ModelSourceError(f"{self.path}: GGUF metadata {key} = {value!r} is invalid.")
        return int(value)

    def floats(self, key: str, default: tuple[float, float, float]) -> list[float]:
        value = self.get(key, list(default))
        if not isinstance(value, list) or len(value) != 3:
            raise ModelSourceError(
                f"{self.path}: GGUF metadata {key} = {value!r} is not three channel values."
            )
        return [_decimal(v) for v in value]


def _check_kind(path: Path, meta: _Metadata) -> None:
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise ModelSourceError(
            f"{path} is not a vision projector (mmproj) file: its architecture is "
            f"{arch!r}, not {ARCHITECTURE!r}."
        )
    if not meta.get("clip.has_vision_encoder", False):
        raise ModelSourceError(f"{path} is an mmproj file without a vision encoder.")
    # Files that hold audio as well name each modality's projector apart.
    kind = meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")
    if kind is None:
        raise ModelSourceError(f"{path}: GGUF metadata lacks clip.projector_type.")
    if kind != PROJECTOR_TYPE:
        raise UnsupportedModelError(
            f"{path}: vision projector type {kind!r} is not supported (only "
            f"{PROJECTOR_TYPE!r}, Gemma 3's, is)."
        )


def _config(path: Path, meta: _Metadata, text_config: dict[str, Any]) -> dict[str, Any]:
    """mlx-vlm's Gemma 3 config for the tower, its projector and ``text_config``."""
    image_size = meta.int("clip.vision.image_size")
    patch_size = meta.int("clip.vision.patch_size")
    scale = meta.int("clip.vision.projector.scale_factor", DEFAULT_SCALE)
    patches = image_size // patch_size
    if image_size % patch_size or patches % scale:
        raise ModelSourceError(
            f"{path}: {image_size}px images in {patch_size}px patches do not pool evenly "
            f"by the projector's scale factor {scale}."
        )
    text_hidden = int(text_config["hidden_size"])
    projection = meta.int("clip.vision.projection_dim", text_hidden)
    if projection != text_hidden:
        raise ModelSourceError(
            f"{path}: the projector makes embeddings of size {projection}, but the language "
            f"model's hidden size is {text_hidden}: it belongs to another model."
        )
    tokens = (patches // scale) ** 2
    vision_config = {
        "model_type": "siglip_vision_model",
        "hidden_size": meta.int("clip.vision.embedding_length"),
        "num_hidden_layers": meta.int("clip.vision.block_count"),
        "intermediate_size": meta.int("clip.vision.feed_forward_length"),
        "num_attention_heads": meta.int("clip.vision.attention.head_count"),
        "patch_size": patch_size,
        "image_size": image_size,
        "layer_norm_eps": _decimal(
            meta.get("clip.vision.attention.layer_norm_epsilon", DEFAULT_LAYER_NORM_EPS)
        ),
    }
    text = {**text_config, "mm_tokens_per_image": tokens}
    # mlx-vlm names the global layers' rope base apart from the local one.
    if "rope_theta" in text:
        text.setdefault("rope_global_base_freq", text["rope_theta"])
    config = {
        "model_type": "gemma3",
        # mlx-vlm scales image features by the top-level hidden size: the text model's.
        "hidden_size": text_hidden,
        "mm_tokens_per_image": tokens,
        "text_config": text,
        "vision_config": vision_config,
        "image_mean": meta.floats("clip.vision.image_mean", DEFAULT_IMAGE_MEAN),
        "image_std": meta.floats("clip.vision.image_std", DEFAULT_IMAGE_STD),
    }
    if "vocab_size" in text_config:
        config["vocab_size"] = text_config["vocab_size"]
    return config


def _decimal(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07), as the config it was converted from wrote it."""
    return float(str(np.float32(value)))


def _hf_name(param: str) -> str:
    """The Hugging Face name of an mlx-vlm parameter, the one the name map knows: the
    projection is a bare ``..._weight`` parameter there, a ``.weight`` in the map."""
    return param[: -len("_weight")] + ".weight" if param.endswith("_weight") else param
