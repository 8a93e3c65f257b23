"""Fixtures for mmproj files: a tiny random Gemma 3 vision model, written as llama.cpp's
converter writes a vision projector (written here independently of gmlx's reader).

The converter takes the Hugging Face tensors, renames the projection parameter
``..._weight`` to ``....weight``, adds 1 to ``mm_soft_emb_norm`` (Gemma's ``1 + w``),
maps names through the ``gguf`` package's table for the ``clip`` architecture and keeps
the patch embedding as the Hugging Face convolution kernel ``[out, in, kh, kw]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf import quants as gguf_quants

from gmlx.engine.loading.demo_vision import (
    BOI_TOKEN,
    EOI_TOKEN,
    IMAGE_TOKEN,
    model_config,
    random_weights,
)

Q = GGMLQuantizationType
IDS = {BOI_TOKEN: 5, IMAGE_TOKEN: 6, EOI_TOKEN: 7}
VOCAB = 300
PREFIXES = ("vision_tower.", "multi_modal_projector.")


def tiny_config(**vision: Any) -> dict[str, Any]:
    """The demo-vision config (64px images in 8px patches, 16 tokens), with
    ``vision_config`` fields replaced by ``vision`` and, when ``mm_tokens_per_image``
    is among them, the token count moved to where mlx-vlm reads it."""
    tokens = vision.pop("mm_tokens_per_image", None)
    text = {"mm_tokens_per_image": tokens} if tokens is not None else None
    return model_config(VOCAB, IDS, eos_id=1, pad_id=0, text=text, vision=vision)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config as mlx-lm has it for a GGUF (no vision keys)."""
    text = dict(config["text_config"])
    del text["mm_tokens_per_image"], text["rope_global_base_freq"]
    return text


def vision_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """Random weights of a Gemma 3 model of ``config`` whose vision norms and biases are
    random too (initialized they are all ones and zeros, which a lost offset or a
    swapped tensor would not show)."""
    weights = random_weights(config, seed)
    rng = np.random.default_rng(seed)
    for name, value in weights.items():
        if name.startswith(PREFIXES) and value.ndim == 1:
            # LayerNorm weights near 1; biases and the (1 + w) RMSNorm's weight near 0.
            around = 1.0 if name.endswith(".weight") and "soft_emb" not in name else 0.0
            noise = rng.standard_normal(value.shape).astype(np.float32) * 0.1
            weights[name] = mx.array(noise + around)
    return weights


def llama_cpp_types(weights: dict[str, mx.array], matmul: GGMLQuantizationType) -> dict[str, Any]:
    """The tensor types llama.cpp's converter picks for a ``matmul``-typed mmproj: the
    input projection stays F16, the embeddings F32, 1-D tensors F32."""
    types: dict[str, GGMLQuantizationType] = {}
    for name, value in weights.items():
        if "input_projection" in name:
            types[name] = Q.F16
        elif ".embeddings." in name or value.ndim < 2:
            types[name] = Q.F32
        else:
            types[name] = matmul
    return types


def hf_value(value: mx.array) -> np.ndarray:
    """An mlx-vlm parameter as the Hugging Face tensor (float32)."""
    w = np.array(value.astype(mx.float32))
    if w.ndim == 4:  # MLX's conv kernel [out, kh, kw, in] -> [out, in, kh, kw]
        w = w.transpose(0, 3, 1, 2)
    return w


def write_mmproj(
    path: Path,
    vlm_weights: dict[str, mx.array],
    config: dict[str, Any],
    qtypes: dict[str, GGMLQuantizationType] | None = None,
    *,
    projector_type: str = "gemma3",
) -> None:
    """Write the vision tower and projector of ``vlm_weights`` (mlx-vlm names; others are
    ignored) as an mmproj file; ``qtypes`` gives a type per parameter (default F32)."""
    vision = config["vision_config"]
    text_hidden = config["text_config"]["hidden_size"]
    patches = vision["image_size"] // vision["patch_size"]
    scale = patches // int(config["mm_tokens_per_image"] ** 0.5)

    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ])
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector_type)
    writer.add_vision_projection_dim(text_hidden)
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    writer.add_vision_image_mean(config.get("image_mean", [0.5, 0.5, 0.5]))
    writer.add_vision_image_std(config.get("image_std", [0.5, 0.5, 0.5]))
    writer.add_vision_use_gelu(True)
    if scale != 4:  # the converter leaves the default out
        writer.add_vision_projector_scale_factor(scale)

    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for param, value in sorted(vlm_weights.items()):
        if not param.startswith(PREFIXES):
            continue
        w = hf_value(value)
        hf_name = param.replace("_weight", ".weight")
        if "soft_emb_norm.weight" in hf_name:
            w = w + 1.0
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        qtype = (qtypes or {}).get(param, Q.F32)
        raw = gguf_quants.quantize(w, qtype)
        writer.add_tensor(gguf_name, raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_language_gguf(path: Path) -> None:
    """A (minimal) language-model GGUF: architecture gemma3, one tensor."""
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tiny_vlm() -> tuple[dict[str, Any], dict[str, mx.array]]:
    """The tiny Gemma 3 config and its random weights, made once per session."""
    config = tiny_config()
    return config, vision_weights(config, seed=7)
