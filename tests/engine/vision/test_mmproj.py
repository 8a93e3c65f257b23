"""Reading llama.cpp's mmproj files into mlx-vlm's Gemma 3 vision tower and projector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, get_tensor_name_map
from gguf import quants as gguf_quants
from mlx import nn

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.loading import mmproj
from gmlx.engine.loading.gguf_file import GGUFFile
from gmlx.engine.vision.classes import vlm_model

from .conftest import (
    PREFIXES,
    llama_cpp_types,
    text_config,
    tiny_config,
    vision_weights,
    write_language_gguf,
    write_mmproj,
)

Q = GGMLQuantizationType
Tiny = tuple[dict[str, Any], dict[str, mx.array]]


def vision_only(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k: v for k, v in weights.items() if k.startswith(PREFIXES)}


def features(model: nn.Module, pixels: mx.array) -> mx.array:
    """Projected image features, as mlx-vlm computes them for a prompt's images."""
    hidden = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)[0]
    return model.multi_modal_projector(hidden)


def model_with(config: dict[str, Any], weights: dict[str, mx.array], strict: bool) -> nn.Module:
    model = vlm_model(config)
    model.load_weights(list(weights.items()), strict=strict)
    mx.eval(model.parameters())
    return model


def pixels(config: dict[str, Any], seed: int = 3) -> mx.array:
    size = config["vision_config"]["image_size"]
    return mx.random.normal((2, 3, size, size), key=mx.random.key(seed))


def test_f32_round_trip_is_exact(tmp_path: Path, tiny_vlm: Tiny) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj-f32.gguf"
    write_mmproj(path, weights, config)

    projector = mmproj.read(path, text_config(config))

    original = vision_only(weights)
    assert projector.weights.keys() == original.keys()
    for name, value in original.items():
        got = projector.weights[name]
        assert got.dtype == mx.float32, name
        if "soft_emb_norm" in name:  # stored as 1 + w: float32 rounding of that sum
            np.testing.assert_allclose(np.array(got), np.array(value), rtol=0, atol=2**-23)
        else:
            np.testing.assert_array_equal(np.array(got), np.array(value), err_msg=name)
    assert projector.notes[0] == f"tensor types: F32 x{len(original)}"


def test_f16_round_trip_is_within_fp16_rounding(tmp_path: Path, tiny_vlm: Tiny) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj-f16.gguf"
    write_mmproj(path, weights, config, llama_cpp_types(vision_only(weights), Q.F16))

    projector = mmproj.read(path, text_config(config))

    for name, value in vision_only(weights).items():
        got = projector.weights[name]
        assert got.dtype == mx.float16, name
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)),
            np.array(value),
            rtol=2**-11,
            atol=2**-24,
            err_msg=name,
        )


@pytest.mark.parametrize("matmul", [Q.Q8_0, Q.Q4_0, Q.Q5_1])
def test_quantized_tensors_equal_the_reference_dequantization(
    tmp_path: Path, tiny_vlm: Tiny, matmul: GGMLQuantizationType
) -> None:
    config, weights = tiny_vlm
    path = tmp_path / f"mmproj-{matmul.name}.gguf"
    types = llama_cpp_types(vision_only(weights), matmul)
    write_mmproj(path, weights, config, types)

    projector = mmproj.read(path, text_config(config))

    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, config["vision_config"]["num_hidden_layers"])
    by_tensor = {
        names.get_name(p.replace("_weight", ".weight"), try_suffixes=(".weight", ".bias")): p
        for p in projector.weights
    }
    reader = GGUFReader(path)
    assert {t.name for t in reader.tensors} == by_tensor.keys()
    for tensor in reader.tensors:
        param = by_tensor[tensor.name]
        expected = gguf_quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        expected = expected.reshape(tuple(reversed(tensor.shape.tolist())))
        if expected.ndim == 4:
            expected = expected.transpose(0, 2, 3, 1)
        if tensor.name.startswith("mm.soft_emb_norm."):
            expected = expected - 1.0
        got = projector.weights[param]
        assert got.dtype == mx.float16, param
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)),
            expected.astype(np.float16).astype(np.float32),
            err_msg=param,
        )
    assert f"{matmul.name} x{sum(t == matmul for t in types.values())}" in projector.notes[0]


@pytest.mark.parametrize(
    ("vision", "scale_written"),
    [
        ({}, True),  # 8 patches a side pooled by 2
        ({"image_size": 32, "patch_size": 2, "mm_tokens_per_image": 16}, False),  # by 4
    ],
)
def test_config_read_back(tmp_path: Path, vision: dict[str, Any], scale_written: bool) -> None:
    config = tiny_config(**vision)
    config["image_mean"] = [0.48, 0.46, 0.41]
    config["image_std"] = [0.27, 0.26, 0.28]
    weights = vision_weights(config, seed=5)
    path = tmp_path / "mmproj.gguf"
    write_mmproj(path, weights, config)
    key = "clip.vision.projector.scale_factor"
    assert (key in GGUFFile(path).metadata) == scale_written

    text = text_config(config)
    got = mmproj.read(path, text).config

    assert got["model_type"] == "gemma3"
    assert got["hidden_size"] == text["hidden_size"]
    assert got["mm_tokens_per_image"] == config["mm_tokens_per_image"]
    assert got["vision_config"] == config["vision_config"]
    assert got["text_config"] == {
        **text,
        "mm_tokens_per_image": config["mm_tokens_per_image"],
        "rope_global_base_freq": text["rope_theta"],
    }
    assert got["image_mean"] == config["image_mean"]
    assert got["image_std"] == config["image_std"]
    vlm_model(got)  # mlx-vlm builds a model from it


@pytest.mark.parametrize(("matmul", "tolerance"), [(None, 1e-6), (Q.F16, 2e-2), (Q.Q8_0, 5e-2)])
def test_projected_features_match_the_original_model(
    tmp_path: Path, tiny_vlm: Tiny, matmul: GGMLQuantizationType | None, tolerance: float
) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj.gguf"
    # None: every tensor F32, so the features are the original's to float32 rounding.
    types = None if matmul is None else llama_cpp_types(vision_only(weights), matmul)
    write_mmproj(path, weights, config, types)
    original = model_with(config, weights, strict=True)

    projector = mmproj.read(path, text_config(config))
    loaded = model_with(projector.config, projector.weights, strict=False)

    x = pixels(config)
    want = features(original, x)
    dtype = projector.weights["multi_modal_projector.mm_soft_emb_norm.weight"].dtype
    got = features(loaded, x.astype(dtype))
    assert got.shape == (2, config["mm_tokens_per_image"], config["text_config"]["hidden_size"])
    scale = float(mx.abs(want).max())
    err = float(mx.abs(got.astype(mx.float32) - want).max())
    assert err <= tolerance * scale, (err, scale)


def test_a_language_model_gguf_is_not_a_projector(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_language_gguf(path)
    with pytest.raises(ModelSourceError, match="not a vision projector") as e:
        mmproj.read(path, text_config(tiny_config()))
    assert not isinstance(e.value, UnsupportedModelError)


def test_another_projector_type_is_unsupported(tmp_path: Path, tiny_vlm: Tiny) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj-llava.gguf"
    write_mmproj(path, weights, config, projector_type="llava")
    with pytest.raises(UnsupportedModelError, match="'llava'.*only 'gemma3'"):
        mmproj.read(path, text_config(config))


def test_a_missing_tensor_is_named(tmp_path: Path, tiny_vlm: Tiny) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj-partial.gguf"
    partial = dict(weights)
    del partial["vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight"]
    write_mmproj(path, partial, config)
    with pytest.raises(ModelSourceError, match=r"lacks the tensor v\.blk\.1\.ffn_down\.weight"):
        mmproj.read(path, text_config(config))


def test_a_projector_for_another_text_model_is_refused(tmp_path: Path, tiny_vlm: Tiny) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj.gguf"
    write_mmproj(path, weights, config)
    other = {**text_config(config), "hidden_size": 256}
    with pytest.raises(ModelSourceError, match="hidden size is 256"):
        mmproj.read(path, other)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path: Path, tiny_vlm: Tiny) -> None:
    config, weights = tiny_vlm
    path = tmp_path / "mmproj-bad.gguf"
    bad = dict(weights)
    bad["vision_tower.vision_model.embeddings.position_embedding.weight"] = mx.zeros((32, 64))
    write_mmproj(path, bad, config)
    with pytest.raises(ModelSourceError, match=r"v\.position_embd\.weight has shape \[32, 64\]"):
        mmproj.read(path, text_config(config))
