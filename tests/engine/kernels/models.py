"""Tiny mlx-lm models of one family each, random weights, for the kernels' tests."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
from mlx import nn

# what a family needs beyond the common keys (qwen3 and gemma3 name their head size;
# gemma3's window of 4 keys on every other layer wraps its rotating cache in a short test)
EXTRA = {
    "qwen3": {"head_dim": 32},
    "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 4, "sliding_window_pattern": 2},
}


def tiny(family: str, layers: int, *, quantized: bool = False, dtype: Any = None, seed: int = 5,
         heads: int = 4) -> nn.Module:
    """A ``layers``-layer model of ``family`` (hidden 128, ``heads`` heads of ``128 /
    heads``, half as many key-value heads, vocabulary 256), its weights 4-bit with
    ``quantized``, cast to ``dtype`` if given."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    extra = EXTRA.get(family, {}) | ({"head_dim": 128 // heads} if "head_dim" in EXTRA.get(family, {}) else {})
    args = module.ModelArgs.from_dict(dict(  # from_dict: each family takes the keys it knows
        model_type=family, hidden_size=128, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), rms_norm_eps=1e-5, vocab_size=256,
        rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=512, **extra))
    mx.random.seed(seed)
    model = module.Model(args)
    if dtype is not None:
        model.set_dtype(dtype)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def steps(model: nn.Module, cache: list, prompts: mx.array, n: int = 4) -> list[mx.array]:
    """The prompt's logits, then ``n`` greedy decode steps' (each stream a token)."""
    out = [model(prompts, cache=cache)]
    for _ in range(n):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    mx.eval(out)
    return out


def one_row_kernels(model: nn.Module) -> None:
    """Every quantized layer of ``model`` on the one-row kernel's path at one row (as a
    CUDA load's tuner leaves an 8B's)."""
    from gmlx.engine.kernels import fast_linear

    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = fast_linear.FastQuantizedLinear
            m.set_paths({1: (fast_linear.GEMV, (4, 2))})


def step_clock(monkeypatch: Any, taken: Any, faster: dict[int, float], drift: float = 0.0) -> list[tuple[int, bool]]:
    """A clock for whole decode steps (this CPU cannot time a CUDA kernel), standing in for
    ``timing.step_time``: 1.0 s a step, ``faster[rows]`` while ``taken(model, rows)``
    says the kernel under test is in use, each step ``drift`` faster than the one timed
    before (a machine warming up); returns what was timed, (rows, taken) each."""
    from gmlx.engine.kernels import timing

    timed: list[tuple[int, bool]] = []

    def step_time(model: Any, rows: int) -> float:
        on = taken(model, rows)
        warmer = 1.0 - drift * len(timed)
        timed.append((rows, on))
        return (faster.get(rows, 1.0) if on else 1.0) * warmer

    monkeypatch.setattr(timing, "step_time", step_time)
    return timed


def rotated(x, offset, inv, pairs):
    """``x`` (``(B, heads, 1, D)``) rotated as the in-place kernel's folded rope rotates it."""
    angles = (offset.astype(mx.float32)[:, None] * inv[None]).reshape(x.shape[0], 1, 1, -1)
    cos, sin = mx.cos(angles), mx.sin(angles)
    f = x.astype(mx.float32)
    if pairs == "half":
        a, b = mx.split(f, 2, axis=-1)
        return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)
    a, b = f[..., 0::2], f[..., 1::2]
    return mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape).astype(x.dtype)
