"""GGUF files as a model source: llama.cpp's format run by mlx-lm's model classes.

The file is memory-mapped; tensors are converted one at a time into MLX arrays (MLX's
own quantized layout where the GGML block geometry allows, see ``gguf_quant``), so the
weights exist once in memory; the result is kept on disk (``convert_cache``), so later
loads of the same file skip the conversion. Architecture metadata becomes an mlx-lm config
(``gguf_arch``) and the tokenizer is rebuilt from ``tokenizer.ggml.*`` (``gguf_tokenizer``),
also once: the cache entry keeps it, and a cached load never decodes the vocabulary.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
from gguf import GGMLQuantizationType
from mlx import nn

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.loading import convert_cache, gguf_arch, gguf_quant, progress
from gmlx.engine.loading.gguf_file import GGUFFile
from gmlx.engine.loading.gguf_quant import QuantizedTensor
from gmlx.engine.loading.gguf_tokenizer import TokenizerSpec, build_spec, build_tokenizer
from gmlx.engine.loading.model import LoadedModel
from gmlx.engine.tokenizer import Tokenizer

Q = GGMLQuantizationType


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer and chat template of a GGUF file (vocab-only files included)."""
    return build_tokenizer(path, GGUFFile(path).metadata)


def load(path: Path) -> LoadedModel:
    """Load a GGUF model into an mlx-lm model class.

    Raises UnsupportedModelError for an architecture or tensor type gmlx cannot run
    and ModelSourceError for a file that is not a complete, valid model.
    """
    progress.phase("read")
    f = GGUFFile(path, defer_strings=True)  # the vocabulary is decoded only if needed
    arch = gguf_arch.architecture(path, f.metadata)
    config = gguf_arch.model_config(path, f.metadata, {n: t.shape for n, t in f.tensors.items()})
    check_types(path, f)

    from gmlx.engine.mlxlm import model_classes

    model_class, args_class = model_classes(config)
    try:
        model: nn.Module = model_class(args_class.from_dict(config))
    except Exception as e:  # ModelArgs validation raises ValueError/TypeError/KeyError
        raise ModelSourceError(f"{path}: its metadata does not make a valid model: {e}.") from e

    dtype = model_dtype(f)
    def tokenizer_spec() -> TokenizerSpec:
        f.read_deferred()
        return build_spec(path, f.metadata)

    converted = convert_cache.load_or_convert(
        f, dtype, lambda: _convert_tensors(path, f, arch, config, model, dtype), tokenizer_spec
    )
    weights, modes, notes = converted.weights, converted.modes, converted.notes
    assert converted.tokenizer is not None
    tokenizer = converted.tokenizer.tokenizer()
    if hasattr(model, "sanitize"):  # on every load: some sanitizers also set up the model
        weights = model.sanitize(weights)  # (Gemma 3 ties its output to the embeddings)
    if modes:
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                {"group_size": modes[p][0], "bits": modes[p][1], "mode": "affine"}
                if p in modes and hasattr(m, "to_quantized")
                else False
            ),
        )
        config["quantization"] = _quantization_config(modes)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelSourceError(f"{path}: its tensors do not fit the {arch.name} model: {e}") from e
    if "rope_freqs.weight" in f.tensors:
        rope_freqs = f.tensors["rope_freqs.weight"]
        factors = gguf_quant.to_float(f.raw(rope_freqs.name), rope_freqs.qtype, mx.float32)
        gguf_arch.apply_rope_factors(model, config, factors)
        notes.append("rope: per-dimension frequency factors from rope_freqs.weight")
    mx.eval(model.parameters())
    model.eval()

    name = f.metadata.get("general.name") or path.stem
    return LoadedModel(
        id=path.stem,
        model=model,
        tokenizer=tokenizer,
        config={**config, "name": name},
        source=path,
        kind="gguf",
        context_length=int(config["max_position_embeddings"]),
        notes=notes,
    )


def check_types(path: Path, f: GGUFFile) -> None:
    unsupported = sorted(
        {t.qtype.name for t in f.tensors.values() if t.qtype not in gguf_quant.SUPPORTED_TYPES}
    )
    if unsupported:
        raise UnsupportedModelError(
            f"{path}: tensor type(s) {', '.join(unsupported)} are not supported (supported: "
            f"{', '.join(t.name for t in gguf_quant.SUPPORTED_TYPES)})."
        )


def model_dtype(f: GGUFFile, ranks: tuple[int, ...] = (2,)) -> mx.Dtype:
    """Float type for unquantized weights, scales and biases: the file's own float type
    for its big float tensors (those of ``ranks`` dimensions: BF16 stays bf16, a file
    all F32 float32), else float16."""
    kinds = Counter(t.qtype for t in f.tensors.values() if len(t.shape) in ranks)
    floats = [k for k, _ in kinds.most_common() if k in gguf_quant.FLOAT_TYPES]
    if floats and floats[0] == Q.BF16:
        return mx.bfloat16
    if floats and floats[0] == Q.F32 and all(k in gguf_quant.FLOAT_TYPES for k in kinds):
        return mx.float32
    return mx.float16


def _convert_tensors(
    path: Path,
    f: GGUFFile,
    arch: gguf_arch.Architecture,
    config: dict[str, Any],
    model: nn.Module,
    dtype: mx.Dtype,
) -> convert_cache.Converted:
    """Every tensor as mlx-lm parameters (before the model's ``sanitize``: what the
    cache stores), one tensor at a time from the memory map, with the quantized modules'
    ``(group_size, bits)`` and the load-log notes.
    """
    quantizable = {p for p, m in model.named_modules() if hasattr(m, "to_quantized")}
    weights: dict[str, mx.array] = {}
    quantized: dict[str, QuantizedTensor] = {}
    notes: list[str] = []
    requantized: list[str] = []
    skipped: list[str] = []
    progress.phase("convert", total=len(f.tensors))
    for name, info in f.tensors.items():
        progress.advance()
        param = gguf_arch.parameter_name(arch, name)
        if param is None:
            if name != "rope_freqs.weight":
                skipped.append(name)
            continue
        raw = f.raw(name)
        if (heads := gguf_arch.qk_heads(arch, name, config)) is not None:
            raw = gguf_arch.unpermute_rows(raw, heads)
        module = param.rsplit(".", 1)[0]
        if len(info.shape) == 2 and param.endswith(".weight") and module in quantizable:
            value = gguf_quant.convert(raw, info.qtype, dtype)
        else:
            value = gguf_quant.to_float(raw, info.qtype, mx.float32)
            if arch.norm_shift and gguf_arch.is_norm(name):
                value = value - arch.norm_shift
            value = value.astype(dtype)
        if isinstance(value, QuantizedTensor):
            quantized[module] = value
            weights[f"{module}.weight"] = value.weight
            weights[f"{module}.scales"] = value.scales
            weights[f"{module}.biases"] = value.biases
            if value.max_error is not None:
                requantized.append(
                    f"{name} ({info.qtype.name} -> {value.bits}-bit group {value.group_size}, "
                    f"max error {value.max_error:.3g})"
                )
        else:
            weights[param] = value
            # Materialize now so no lazy graph keeps the float32 intermediate alive.
            mx.eval(value)
    if requantized:
        notes.append(f"requantized {len(requantized)} tensor(s): " + "; ".join(requantized))
    if skipped:
        notes.append(f"ignored tensor(s) with no mlx-lm parameter: {', '.join(skipped)}")
    counts = Counter(info.qtype.name for info in f.tensors.values())
    notes.insert(0, "tensor types: " + ", ".join(f"{k} x{v}" for k, v in counts.most_common()))
    modes = {name: (t.group_size, t.bits) for name, t in quantized.items()}
    return convert_cache.Converted(weights, modes, notes)


def _quantization_config(modes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """mlx-lm's ``quantization`` config: the commonest mode plus per-layer overrides."""
    (group, bits), _ = Counter(modes.values()).most_common(1)[0]
    config: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for path, (g, b) in modes.items():
        if (g, b) != (group, bits):
            config[path] = {"group_size": g, "bits": b, "mode": "affine"}
    return config
