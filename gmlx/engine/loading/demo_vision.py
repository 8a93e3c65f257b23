"""The built-in ``demo-vision`` model: the ``demo`` model's vision twin.

A tiny random Gemma 3 vision-language model (a SigLIP vision tower, hidden 64, two
layers, 64-pixel images in 8-pixel patches pooled to 16 tokens; a Gemma 3 text model,
hidden 128, two layers) saved as an mlx-vlm model folder, with the demo's byte-level
BPE tokenizer plus Gemma 3's image tokens and a ChatML template that writes
``<start_of_image>`` where a message has an image. Built on first use into the gmlx
cache, with no download, so ``gmlx serve demo-vision`` exercises every image path on
any machine. Its text is meaningless, but it conditions on the image: different
images give different greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gmlx.engine.loading.demo import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer,
    ensure,
    load_built,
    load_built_tokenizer,
    write_folder,
)
from gmlx.engine.loading.model import LoadedModel
from gmlx.paths import cache_dir

DEMO_VISION_ID = "demo-vision"
VERSION = 2  # bump whenever the built files change
SEED = 20261201

BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
VISION_SPECIALS = [*SPECIAL_TOKENS, BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN]

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_global_base_freq": 10000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window": 1024,
    "sliding_window_pattern": 2,
    "max_position_embeddings": 8192,
    "mm_tokens_per_image": 16,
}

VISION_CONFIG: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "patch_size": 8,
    "image_size": 64,
    "layer_norm_eps": 1e-6,
}

# Gemma 3's preprocessing: resize to the square input, scale to [0, 1], normalize.
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Gemma3ImageProcessor",
    "size": {"height": VISION_CONFIG["image_size"], "width": VISION_CONFIG["image_size"]},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 1 / 255,
    "resample": 2,
    "image_seq_length": TEXT_CONFIG["mm_tokens_per_image"],
}

# The demo's ChatML template, with images: a message's content may be a list of
# parts, where an image part becomes the image marker.
VISION_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for message in messages %}",
    "{%- for message in messages %}\n"
    "{%- if message.content is not string and message.content is not none %}"
    "{%- set parts = namespace(text='') %}"
    "{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{%- set parts.text = parts.text + '" + BOI_TOKEN + "' %}"
    "{%- else %}{%- set parts.text = parts.text + part.text %}{%- endif %}"
    "{%- endfor %}"
    "{%- set message = dict(message, content=parts.text) %}"
    "{%- endif %}",
    1,
)


def demo_vision_dir() -> Path:
    return cache_dir() / "models" / f"demo-vision-v{VERSION}"


def model_config(vocab_size: int, ids: dict[str, int], eos_id: int, pad_id: int, *,
                 text: dict[str, Any] | None = None,
                 vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mlx-vlm ``config.json`` of a tiny Gemma 3 vision model, ``text`` and ``vision``
    overriding entries of its text and vision configs (a benchmark's larger shape, a
    test's variant); the top-level keys mlx-vlm reads follow the text config."""
    text_config = {**TEXT_CONFIG, **(text or {}), "vocab_size": vocab_size}
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "hidden_size": text_config["hidden_size"],
        "vocab_size": vocab_size,
        "image_token_index": ids[IMAGE_TOKEN],
        "boi_token_index": ids[BOI_TOKEN],
        "eoi_token_index": ids[EOI_TOKEN],
        "mm_tokens_per_image": text_config["mm_tokens_per_image"],
        "pad_token_id": pad_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "text_config": text_config,
        "vision_config": {**VISION_CONFIG, **(vision or {})},
    }


def random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Seeded random weights for an mlx-vlm Gemma 3 model of ``config``, scaled so the
    model's greedy output depends on its context and its images."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from gmlx.engine.vision.classes import vlm_model

    mx.random.seed(seed)
    model = vlm_model(config)
    weights = dict(tree_flatten(model.parameters()))
    text_hidden = config["text_config"]["hidden_size"]
    vision_hidden = config["vision_config"]["hidden_size"]
    # mlx-vlm starts the projection at all ones, which maps every image to nearly the
    # same vector: a random projection keeps images apart.
    weights["multi_modal_projector.mm_input_projection_weight"] = mx.random.normal(
        (vision_hidden, text_hidden)
    ) * (vision_hidden**-0.5)
    weights["language_model.model.embed_tokens.weight"] = (
        weights["language_model.model.embed_tokens.weight"] * 0.25
    )
    weights["language_model.lm_head.weight"] = weights["language_model.lm_head.weight"] * 8.0
    mx.eval(weights)
    return weights


def build(target: Path, *, text: dict[str, Any] | None = None,
          vision: dict[str, Any] | None = None, seed: int = SEED) -> None:
    """Write the demo-vision model folder (config, weights, tokenizer) to ``target``;
    ``text`` and ``vision`` as in :func:`model_config`."""
    import mlx.core as mx
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(VISION_SPECIALS)
    ids = {t: tok.token_to_id(t) for t in VISION_SPECIALS}
    config = model_config(tok.get_vocab_size(), ids, ids[EOS_TOKEN], ids["<|endoftext|>"],
                          text=text, vision=vision)
    weights = random_weights(config, seed)
    preprocessor = dict(PREPROCESSOR_CONFIG, image_seq_length=config["mm_tokens_per_image"])
    size = config["vision_config"]["image_size"]
    preprocessor["size"] = {"height": size, "width": size}

    def write(folder: Path) -> None:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token=EOS_TOKEN,
            pad_token="<|endoftext|>",
            clean_up_tokenization_spaces=False,
            model_max_length=TEXT_CONFIG["max_position_embeddings"],
            # Gemma 3's processor finds its image tokens by these names.
            extra_special_tokens={"boi_token": BOI_TOKEN, "image_token": IMAGE_TOKEN,
                                  "eoi_token": EOI_TOKEN},
        )
        hf.chat_template = VISION_TEMPLATE
        hf.save_pretrained(str(folder))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[EOS_TOKEN]}))

    write_folder(target, write)


def ensure_built() -> Path:
    """The demo-vision model folder, building it first if it is not in the cache yet."""
    return ensure(demo_vision_dir(), build)


def load() -> LoadedModel:
    return load_built(ensure_built(), DEMO_VISION_ID)


def load_tokenizer():
    return load_built_tokenizer(ensure_built())
