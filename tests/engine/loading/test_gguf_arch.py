"""Metadata -> mlx-lm config, tensor names and llama.cpp's layout changes."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from gmlx.engine.errors import UnsupportedModelError
from gmlx.engine.loading import gguf_arch

ARCH = gguf_arch.ARCHITECTURES


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF rope layout -> GGML's)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("shape", [(32,), (32, 8)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...]) -> None:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(gguf_arch.unpermute_rows(_permute(w, 4), 4), w)


def test_only_llama_qk_are_unpermuted() -> None:
    config = {"num_attention_heads": 8, "num_key_value_heads": 2}
    assert gguf_arch.qk_heads(ARCH["llama"], "blk.0.attn_q.weight", config) == 8
    assert gguf_arch.qk_heads(ARCH["llama"], "blk.0.attn_k.weight", config) == 2
    assert gguf_arch.qk_heads(ARCH["llama"], "blk.0.attn_v.weight", config) is None
    for name in ("qwen2", "qwen3", "gemma3"):
        assert gguf_arch.qk_heads(ARCH[name], "blk.0.attn_q.weight", config) is None


@pytest.mark.parametrize(
    ("arch", "gguf", "mlx"),
    [
        ("llama", "token_embd.weight", "model.embed_tokens.weight"),
        ("llama", "output.weight", "lm_head.weight"),
        ("llama", "blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("qwen2", "blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ("qwen3", "blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
        ("gemma3", "blk.2.ffn_norm.weight", "model.layers.2.pre_feedforward_layernorm.weight"),
        (
            "gemma3",
            "blk.2.post_ffw_norm.weight",
            "model.layers.2.post_feedforward_layernorm.weight",
        ),
        ("llama", "rope_freqs.weight", None),
    ],
)
def test_parameter_names(arch: str, gguf: str, mlx: str | None) -> None:
    assert gguf_arch.parameter_name(ARCH[arch], gguf) == mlx


def test_config_from_metadata() -> None:
    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 4,
        "llama.embedding_length": 256,
        "llama.feed_forward_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": np.array([2, 2, 2, 2]),
        "llama.rope.freq_base": 500000.0,
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 8192,
    }
    shapes = {"token_embd.weight": (300, 256)}
    config = gguf_arch.model_config(Path("m.gguf"), metadata, shapes)
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 64
    assert config["rope_theta"] == 500000.0 and config["rope_scaling"]["factor"] == 4.0
    assert config["tie_word_embeddings"] and config["vocab_size"] == 300
    assert config["max_position_embeddings"] == 8192


def test_unsupported_architecture() -> None:
    with pytest.raises(UnsupportedModelError, match="'mamba'.*supported: llama, mistral"):
        gguf_arch.architecture(Path("m.gguf"), {"general.architecture": "mamba"})


def test_factor_rope_with_unit_factors_is_plain_rope() -> None:
    x = mx.random.normal((1, 2, 5, 64))
    plain = nn.RoPE(64, traditional=False, base=10000.0)(x, offset=3)
    factored = gguf_arch.FactorRoPE(64, 10000.0, mx.ones(32))(x, offset=3)
    np.testing.assert_allclose(np.array(factored), np.array(plain), atol=1e-5)
