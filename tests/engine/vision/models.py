"""A tiny Gemma 3 vision model written two ways from the same random weights: an mlx-vlm
model folder (as ``demo_vision.build`` writes one) and a GGUF language model with a
llama.cpp ``mmproj`` projector beside it (written as llama.cpp's converter writes them,
independently of gmlx's readers).

The text model has six layers, so that mlx-lm's Gemma 3 (which indexes the cache of its
first global layer, the sixth) runs with the sliding-window pattern of 6 that a GGUF
always gets; every weight, text norms included, is random and float32.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGUFWriter

from gmlx.engine.loading.demo import EOS_TOKEN, build_tokenizer
from gmlx.engine.loading.demo_vision import (
    PREPROCESSOR_CONFIG,
    VISION_SPECIALS,
    VISION_TEMPLATE,
    model_config,
)

from .conftest import vision_weights, write_mmproj

SEED = 5
EMBED_SCALE = 0.25
PAD_TOKEN = "<|endoftext|>"
TEXT = {
    "num_hidden_layers": 6,
    "sliding_window_pattern": 6,
    "sliding_window": 512,
    "rope_theta": 1_000_000.0,
    "rope_global_base_freq": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# llama.cpp token types
NORMAL, CONTROL = 1, 3
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def tokenizer():
    """The demo-vision tokenizer (``tokenizers``): byte-level BPE with the image tokens."""
    return build_tokenizer(VISION_SPECIALS)


def config_and_weights(tok) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """The mlx-vlm config and float32 random weights (vision norms and biases random,
    and the text model's norms too: near 0, Gemma's ``1 + w``), the output layer tied
    to the embeddings."""
    ids = {t: tok.token_to_id(t) for t in VISION_SPECIALS}
    config = model_config(tok.get_vocab_size(), ids, ids[EOS_TOKEN], ids[PAD_TOKEN], text=TEXT)
    weights = vision_weights(config, SEED)
    rng = np.random.default_rng(SEED + 1)
    for name, value in weights.items():
        if name.startswith("language_model.") and name.endswith("norm.weight"):
            noise = rng.standard_normal(value.shape).astype(np.float32) * 0.1
            weights[name] = mx.array(noise)
    # Tied embeddings, as Gemma 3 has them (mlx-vlm's loader always ties them), at a
    # scale whose logits keep greedy choices apart.
    del weights["language_model.lm_head.weight"]
    embed = "language_model.model.embed_tokens.weight"
    weights[embed] = weights[embed] * EMBED_SCALE
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.eval(weights)
    return config, weights


def write_folder(target: Path, tok, config: dict[str, Any], weights: dict[str, mx.array]) -> Path:
    """An mlx-vlm model folder, as ``demo_vision.build`` writes one."""
    from transformers import PreTrainedTokenizerFast

    target.mkdir(parents=True)
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = VISION_TEMPLATE
    hf.save_pretrained(str(target))
    return target


def gguf_name(name: str) -> str:
    """llama.cpp's name for an mlx-lm Gemma 3 text parameter."""
    if name in _TOP:
        return _TOP[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def write_gguf(path: Path, tok, config: dict[str, Any], weights: dict[str, mx.array]) -> Path:
    """The text model as a gemma3 GGUF (F32, norms stored as ``1 + w``) with the same
    vocabulary (byte-level BPE, the specials as control tokens) and chat template."""
    text = config["text_config"]
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_rope_freq_base(text["rope_theta"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_sliding_window(text["sliding_window"])

    vocab = tok.get_vocab()
    tokens = [""] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in VISION_SPECIALS else NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab[EOS_TOKEN])
    writer.add_pad_token_id(vocab[PAD_TOKEN])
    writer.add_add_bos_token(False)
    writer.add_chat_template(VISION_TEMPLATE)

    for name, value in sorted(weights.items()):
        if not name.startswith("language_model."):
            continue
        name = name.removeprefix("language_model.")
        w = np.array(value.astype(mx.float32))
        if name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_models(root: Path) -> tuple[Path, Path, Path]:
    """The folder, the GGUF and its mmproj (all F32), from the same weights."""
    tok = tokenizer()
    config, weights = config_and_weights(tok)
    folder = write_folder(root / "tiny-vlm", tok, config, weights)
    gguf = write_gguf(root / "tiny-vlm.gguf", tok, config, weights)
    write_mmproj(root / "mmproj-tiny-vlm.gguf", weights, config)
    return folder, gguf, root / "mmproj-tiny-vlm.gguf"


# -- images ----------------------------------------------------------------------------


def png(kind: str, width: int = 64, height: int = 64) -> bytes:
    """A small PNG: ``gradient`` (red across, green down), ``checks`` (black and white
    squares) or ``blue`` (one colour)."""
    from PIL import Image

    if kind == "gradient":
        x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
        y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
        a = np.stack([x, y, 255 - x], axis=-1)
    elif kind == "checks":
        yy, xx = np.mgrid[0:height, 0:width]
        a = np.where(((xx // 8 + yy // 8) % 2)[..., None] == 1, 255.0, 0.0).repeat(3, -1)
    else:
        a = np.zeros((height, width, 3), np.float32) + np.array([20, 40, 220], np.float32)
    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()
