"""Fixtures for the GGUF model source: random GGML blocks and tiny complete GGUF models.

The tiny models are written the way llama.cpp's converter writes them (Q/K rows
permuted for ``llama``, Gemma norms stored as 1 + w), from the weights of an mlx-lm
reference model. Quantized tensors are made first (by the ``gguf`` package where it
can quantize, as random valid blocks otherwise) and the reference model gets their
dequantized values, so reference and GGUF hold the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

Q = GGMLQuantizationType

# Byte offsets of each block's fp16 fields (random bits could be inf/nan there), and
# the range that keeps dequantized weights around +-0.2 for a sane tiny model.
_F16_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, float], ...]] = {
    Q.Q4_0: ((0, 0.05),),
    Q.Q4_1: ((0, 0.05), (2, 0.05)),
    Q.Q5_0: ((0, 0.05),),
    Q.Q5_1: ((0, 0.05), (2, 0.05)),
    Q.Q8_0: ((0, 0.05),),
    Q.Q4_K: ((0, 2e-4), (2, 2e-4)),
    Q.Q5_K: ((0, 1e-4), (2, 1e-4)),
    Q.Q2_K: ((80, 1e-3), (82, 1e-3)),
    Q.Q3_K: ((108, 1e-3),),
    Q.Q6_K: ((208, 5e-5),),
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid raw blocks (rows, row_bytes) of ``qtype``: random bytes with finite,
    small fp16 scale fields."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off, scale in _F16_FIELDS[qtype]:
        d = rng.uniform(-scale, scale, size=len(blocks)).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="session")
def make_blocks() -> Callable[..., np.ndarray]:
    return random_blocks


# -- a small byte-level BPE vocabulary ---------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a ~290-token gpt2-style vocabulary."""
    tokens = list(_bytes_to_unicode().values())
    merges = []
    for left, right in [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("Ġ", "a"),
        ("e", "r"),
        ("o", "n"),
        ("Ġ", "w"),
        ("o", "r"),
        ("l", "l"),
        ("H", "e"),
        ("He", "ll"),
        ("Hell", "o"),
        ("Ġw", "or"),
        ("Ġwor", "l"),
        ("Ġworl", "d"),
        ("Ġ", "s"),
        ("i", "s"),
    ]:
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + SPECIALS, merges, types


# -- tiny models ---------------------------------------------------------------------------


@dataclass
class TinyModel:
    """A GGUF file and the mlx-lm reference model holding the same weights."""

    path: Path
    reference: nn.Module
    config: dict[str, Any]
    qtype: GGMLQuantizationType


ARCH_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(model_type: str, name: str) -> str:
    """llama.cpp's tensor name for an mlx-lm parameter (written independently of gmlx)."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    gemma = model_type == "gemma3_text"
    if module == "post_attention_layernorm":
        part = "post_attention_norm" if gemma else "ffn_norm"
    elif module == "pre_feedforward_layernorm":
        part = "ffn_norm"
    else:
        part = _GGUF_NAMES[module]
    return f"blk.{layer}.{part}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF rope layout -> GGML's)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _config(model_type: str) -> dict[str, Any]:
    config = {
        "model_type": model_type,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(tiny_vocab()[0]),
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": model_type != "llama",
    }
    if model_type == "gemma3_text":
        # mlx-lm's gemma3 indexes the cache of layer 6 (its first global layer).
        config.update(num_hidden_layers=6)
        config.update(
            query_pre_attn_scalar=64,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
        )
    return config


def _quantize(
    w: np.ndarray, qtype: GGMLQuantizationType, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Raw GGUF data for a 2-D weight and its dequantized float32 values."""
    if qtype == Q.F16:
        raw = w.astype(np.float16)
        return raw, raw.astype(np.float32)
    try:
        raw = gguf_quants.quantize(w, qtype)
    except NotImplementedError:
        raw = random_blocks(qtype, *w.shape, seed=seed)
    return raw, gguf_quants.dequantize(raw, qtype)


def write_tiny_model(
    path: Path, model_type: str, qtype: GGMLQuantizationType, seed: int = 0
) -> TinyModel:
    """Write a tiny GGUF of ``model_type`` whose linear/embedding weights are ``qtype``."""
    from mlx_lm.utils import _get_classes

    config = _config(model_type)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    reference = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    arch = ARCH_OF[model_type]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if model_type == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
    tokens, merges, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    params: dict[str, mx.array] = {}
    for i, (name, value) in enumerate(sorted(tree_flatten(reference.parameters()))):
        w = np.array(value.astype(mx.float32))
        if w.ndim == 1:
            # Norm weights near 1 (Gemma: near 0, stored +1); biases small.
            w = (
                rng.standard_normal(w.shape) * 0.1
                + (0.0 if "bias" in name or model_type == "gemma3_text" else 1.0)
            ).astype(np.float32)
            stored = w + 1.0 if model_type == "gemma3_text" and name.endswith("norm.weight") else w
            writer.add_tensor(gguf_name(model_type, name), stored)
            params[name] = mx.array(w)
            continue
        w = (rng.standard_normal(w.shape) * 0.05).astype(np.float32)
        raw, values = _quantize(w, qtype, seed=i)
        if (
            model_type == "llama"
            and ".q_proj." in name
            or model_type == "llama"
            and ".k_proj." in name
        ):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            # The GGUF holds permuted rows; the reference keeps the HF order of the same rows.
            raw = llama_cpp_permute(raw, heads)
        writer.add_tensor(
            gguf_name(model_type, name), raw, raw_dtype=None if qtype == Q.F16 else qtype
        )
        params[name] = mx.array(values)
    reference.update(tree_unflatten(list(params.items())))
    mx.eval(reference.parameters())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, reference, config, qtype)


TINY_MODELS = [
    ("llama", Q.F16),
    ("llama", Q.Q8_0),
    ("llama", Q.Q4_0),
    ("qwen2", Q.Q4_K),
    ("qwen2", Q.Q6_K),
    ("qwen3", Q.Q5_K),
    ("gemma3_text", Q.Q8_0),
]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """Every tiny model of :data:`TINY_MODELS`, written once per session."""
    root = tmp_path_factory.mktemp("gguf")
    return {
        f"{model_type}-{qtype.name}": write_tiny_model(
            root / f"{model_type}-{qtype.name}.gguf", model_type, qtype, seed=n
        )
        for n, (model_type, qtype) in enumerate(TINY_MODELS)
    }
