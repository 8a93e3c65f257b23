"""GGUF architectures -> mlx-lm: config from metadata, parameter names, layout fixes.

llama.cpp's converter changes some tensors on the way into GGUF; this module undoes
that so mlx-lm's model classes (HF layout) run the weights unchanged:

- ``llama`` (and Mistral, which llama.cpp stores as ``llama``): Q and K rows are
  permuted into GGML's interleaved rope layout; :func:`unpermute_rows` restores the
  HF half-split layout mlx-lm's ``nn.RoPE(traditional=False)`` expects. ``qwen2``,
  ``qwen3`` and ``gemma3`` use NEOX rope in llama.cpp and are stored unpermuted.
- ``gemma3``: norm weights are stored with the +1 of Gemma's ``(1 + w)`` RMSNorm
  already added; mlx-lm's gemma3 adds it at run time, so 1 is subtracted again.
- Llama 3.x rope scaling is stored as a ``rope_freqs`` tensor of per-dimension
  factors, not as metadata; :class:`FactorRoPE` applies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class Architecture:
    """How one GGUF ``general.architecture`` maps onto an mlx-lm model."""

    name: str
    model_type: str  # mlx-lm module
    permuted_qk: bool  # llama.cpp stored Q/K in GGML's interleaved rope layout
    norm_shift: float  # added to norm weights by the converter; subtracted here
    ffn_norm: str  # mlx-lm name of GGUF's ``ffn_norm`` (the norm before the MLP)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "llama", True, 0.0, "post_attention_layernorm"),
    "mistral": Architecture("mistral", "llama", True, 0.0, "post_attention_layernorm"),
    "qwen2": Architecture("qwen2", "qwen2", False, 0.0, "post_attention_layernorm"),
    "qwen3": Architecture("qwen3", "qwen3", False, 0.0, "post_attention_layernorm"),
    "gemma3": Architecture("gemma3", "gemma3_text", False, 1.0, "pre_feedforward_layernorm"),
}


def architecture(path: Path, metadata: dict[str, Any]) -> Architecture:
    """The supported architecture a GGUF declares, or UnsupportedModelError naming it."""
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})."
        )
    return ARCHITECTURES[name]


def _scalar(value: Any, key: str, path: Path) -> Any:
    """A metadata value that may be stored per layer (an array) but must be uniform."""
    if isinstance(value, (list, np.ndarray)):
        values = {v.item() if hasattr(v, "item") else v for v in value}
        if len(values) != 1:
            raise UnsupportedModelError(
                f"{path}: {key} varies per layer ({sorted(values)}), which gmlx does not support."
            )
        return values.pop()
    return value.item() if hasattr(value, "item") else value


def model_config(
    path: Path, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """An mlx-lm/HF-style config dict (``model_type``, ``hidden_size``, ...) for the file."""
    arch = architecture(path, metadata)
    prefix = f"{arch.name}."

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        if prefix + key not in metadata:
            if required:
                raise ModelSourceError(f"{path}: GGUF metadata lacks {prefix + key}.")
            return default
        return _scalar(metadata[prefix + key], prefix + key, path)

    if "token_embd.weight" not in tensor_shapes:
        raise ModelSourceError(f"{path} has no token_embd.weight tensor (a vocab-only GGUF?).")
    vocab_size, hidden = tensor_shapes["token_embd.weight"]
    heads = int(get("attention.head_count", required=True))
    head_dim = int(get("attention.key_length", hidden // heads))
    context = int(get("context_length", DEFAULT_CONTEXT))
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": int(get("embedding_length", hidden)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(vocab_size),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
    }
    scaling = _rope_scaling(arch, get)
    if scaling:
        config["rope_scaling"] = scaling
    if arch.name == "gemma3":
        config["sliding_window"] = int(get("attention.sliding_window", 4096))
        # llama.cpp fixes these for Gemma 3: a global layer every 6th, local base 10k,
        # and 27B (62 layers) scales queries by hidden/heads instead of head_dim.
        config["sliding_window_pattern"] = 6
        config["rope_local_base_freq"] = 10000.0
        layers = config["num_hidden_layers"]
        config["query_pre_attn_scalar"] = hidden // heads if layers == 62 else head_dim
    return config


def _rope_scaling(arch: Architecture, get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = get("rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"type": "yarn", "rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UnsupportedModelError(
        f"GGUF rope scaling {kind!r} of {arch.name} is not supported (supported: linear, yarn)."
    )


_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def parameter_name(arch: Architecture, gguf_name: str) -> str | None:
    """The mlx-lm parameter a GGUF tensor becomes, or None for tensors with no parameter."""
    if match := _BLOCK.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        module = arch.ffn_norm if part == "ffn_norm" else _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{module}.{kind}" if module else None
    stem, _, kind = gguf_name.rpartition(".")
    module = _GLOBAL_NAMES.get(stem)
    return f"{module}.{kind}" if module and kind in ("weight", "bias") else None


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (GGML interleaved -> HF half-split rope).

    The converter reshapes rows as (head, 2, head_dim/2) and swaps the last two axes;
    this does the reverse. Works on any row data: floats or rows of quantized blocks.
    """
    head_dim = rows.shape[0] // n_head
    rest = rows.shape[1:]
    grouped = rows.reshape(n_head, head_dim // 2, 2, *rest)
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(rows.shape)


def qk_heads(arch: Architecture, gguf_name: str, config: dict[str, Any]) -> int | None:
    """Heads to unpermute a tensor by, or None when the tensor is stored as in HF."""
    if not arch.permuted_qk:
        return None
    if gguf_name.endswith((".attn_q.weight", ".attn_q.bias")):
        return int(config["num_attention_heads"])
    if gguf_name.endswith((".attn_k.weight", ".attn_k.bias")):
        return int(config["num_key_value_heads"])
    return None


def is_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


class FactorRoPE(nn.Module):
    """Rope whose per-dimension wavelengths are multiplied by GGUF ``rope_freqs`` factors.

    llama.cpp divides each rotation frequency by its factor; ``mx.fast.rope`` takes the
    inverse frequencies (``base ** (2i/d)``), so they are multiplied.
    """

    def __init__(self, dims: int, base: float, factors: mx.array) -> None:
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def apply_rope_factors(model: nn.Module, config: dict[str, Any], factors: mx.array) -> None:
    """Replace every attention's rope with a :class:`FactorRoPE` using ``factors``."""
    dims = int(config["head_dim"])
    rope = FactorRoPE(dims, float(config["rope_theta"]), factors.astype(mx.float32))
    for layer in model.layers:
        layer.self_attn.rope = rope
