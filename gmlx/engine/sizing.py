"""What a model will cost before it loads: its weights and its KV, read off its files.

The load gate prices a model before loading it, and the model listing shows a model's
context window before it is resident; both read only files and headers here, never
the weights:

    weights   GGUF: the file's size; an MLX folder (the demo model's built one too):
              the sum of its ``*.safetensors``
    KV/token  2 x layers x kv_heads x head_dim x dtype bytes, from the GGUF metadata
              (through the loader's own architecture mapping) or ``config.json``
    need      weights + KV/token x ``LOAD_KV_TOKENS`` (at most the context) x width

A model loads its weights as stored (MLX's quantized layout keeps GGUF's blocks at
about their file size), so the file sizes are the weights to within a few percent;
the measured figure (``capacity.weight_bytes``) replaces this once it is resident.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.loading import local_path, source_kind

log = logging.getLogger("gmlx.engine")

LOAD_KV_TOKENS = 2048  # KV each decode stream is priced at when a model loads
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class SourceSize:
    """A model's price read off its files.

    Attributes:
        weight_bytes: the weights as stored (file sizes).
        kv_bytes_per_token: K and V of one token over all layers (None: the metadata
            does not say, so only the weights are priced).
        context_length: the trained context window (None: unknown).
    """

    weight_bytes: int
    kv_bytes_per_token: int | None
    context_length: int | None

    def kv_bytes(self, width: int, max_kv_size: int | None = None) -> int:
        """KV for ``width`` streams of ``LOAD_KV_TOKENS`` tokens each, or of the whole
        context when it is shorter (the trained window, lowered by ``max_kv_size``)."""
        tokens = LOAD_KV_TOKENS
        for limit in (self.context_length, max_kv_size):
            if limit:
                tokens = min(tokens, limit)
        return (self.kv_bytes_per_token or 0) * tokens * max(1, width)

    def need_bytes(self, width: int, max_kv_size: int | None = None) -> int:
        """What loading the model and decoding ``width`` streams needs: its weights
        plus :meth:`kv_bytes`."""
        return self.weight_bytes + self.kv_bytes(width, max_kv_size)


def source_size(source: str) -> SourceSize:
    """Price the model a source names (``demo``, a GGUF file, an MLX folder, ``hf:``)
    from its files and headers; the weights are never read.

    Raises ModelSourceError when the source is missing or is not a model (what loading
    it would raise too).
    """
    kind = source_kind(source)
    if kind == "demo":
        from gmlx.engine.loading import DEMO_VISION_ID, demo, demo_vision

        built = demo_vision.ensure_built() if source == DEMO_VISION_ID else demo.ensure_built()
        return _folder_size(built)
    path = local_path(source)
    if kind == "gguf":
        return _gguf_size(path if path.is_file() else min(path.glob("*.gguf")))
    return _folder_size(path)


def _folder_size(path: Path) -> SourceSize:
    """An MLX model folder: its safetensors and its ``config.json``."""
    from gmlx.engine.loading.mlx_dir import DEFAULT_CONTEXT

    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"{path}/config.json cannot be read: {e}.") from e
    text = config.get("text_config") or config  # a VLM keeps its decoder's config here
    context = (
        text.get("max_position_embeddings") or text.get("max_sequence_length") or text.get("n_ctx")
    )
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "float16")
    return SourceSize(
        weight_bytes=weights,
        kv_bytes_per_token=_kv_per_token(text, _DTYPE_BYTES.get(dtype, 2)),
        # mlx_dir.load falls back to the same default for a config that names none
        context_length=int(context) if context else DEFAULT_CONTEXT,
    )


def _gguf_size(path: Path) -> SourceSize:
    """A GGUF file: its size, and its geometry through the loader's architecture
    mapping (weight-only for an architecture the loader does not know)."""
    from gmlx.engine.errors import UnsupportedModelError
    from gmlx.engine.loading import gguf_arch
    from gmlx.engine.loading.gguf_file import GGUFFile

    f = GGUFFile(path, defer_strings=True)  # pricing needs no vocabulary decoded
    weights = path.stat().st_size
    shapes = {name: t.shape for name, t in f.tensors.items()}
    try:
        config = gguf_arch.model_config(path, f.metadata, shapes)
    except UnsupportedModelError:
        arch = f.metadata.get("general.architecture")
        context = f.metadata.get(f"{arch}.context_length")
        return SourceSize(weights, None, int(context) if context is not None else None)
    return SourceSize(
        weight_bytes=weights,
        kv_bytes_per_token=_kv_per_token(config, _gguf_dtype_bytes(f)),
        context_length=int(config["max_position_embeddings"]),
    )


def _gguf_dtype_bytes(f: Any) -> int:
    """Bytes of the float type a GGUF model computes in, so of its KV, as ``gguf.load``
    picks it: float32 for a file whose matrices are all float with F32 the commonest,
    else 2 (float16, or bfloat16 for a BF16 file)."""
    from gmlx.engine.loading.gguf_quant import FLOAT_TYPES

    kinds = Counter(t.qtype for t in f.tensors.values() if len(t.shape) == 2)
    floats = [k for k, _ in kinds.most_common() if k in FLOAT_TYPES]
    all_float = all(k in FLOAT_TYPES for k in kinds)
    return 4 if floats and floats[0].name == "F32" and all_float else 2


def _kv_per_token(config: dict[str, Any], dtype_bytes: int) -> int | None:
    """2 x layers x kv_heads x head_dim x dtype bytes (None when a figure is missing)."""
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    hidden = config.get("hidden_size") or config.get("n_embd")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * dtype_bytes


class Prices:
    """:func:`source_size` cached per source. A source that cannot be priced (missing,
    or not a model) is None and asked again next time: it may appear."""

    def __init__(self) -> None:
        self._sizes: dict[str, SourceSize] = {}

    def get(self, source: str) -> SourceSize | None:
        if (size := self._sizes.get(source)) is not None:
            return size
        try:
            size = source_size(source)
        except Exception as e:  # noqa: BLE001 - an unpriced model still loads; its load says why
            log.debug("cannot price %s: %s", source, e)
            return None
        self._sizes[source] = size
        return size

    def clear(self) -> None:
        """Forget every price (a reload: a file may have been replaced)."""
        self._sizes.clear()
