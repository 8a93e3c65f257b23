"""An MLP's gate and up projections and the swiglu between them in one CUDA kernel, for
decode steps of one to eight streams.

A llama-pattern MLP (llama and the models mlx-lm runs through it, qwen2, qwen3) computes
``down(swiglu(gate(x), up(x)))``: two quantized products and the swiglu, three kernels a
layer, the two products each reading ``x`` and each writing a ``hidden``-wide result
that the swiglu reads back. Where both projections are quantized in one layout (a
Q4_K_M's are both 4-bit), one kernel reads the two layers' rows side by side and writes
``silu(gate) * up`` (:func:`qgemv_cuda.bound` with ``up``: the one-row source at one
stream, the few-rows source at two to eight), rounded as MLX's products and mlx-lm's
swiglu round it. llama.cpp's CUDA decode fuses the same three.

Only built on CUDA; only for one-token steps of at most eight streams and projections
without biases; off unless ``GMLX_GLU_KERNEL=1`` until measured on a GPU
(``benchmarks/gpu/pipeline_check.py``'s ``glu`` loop, ``bench.py``'s ``gmlx-glu``
server). The tests run the kernel's own source on the CPU against MLX's products and
swiglu (``tests/engine/kernels/test_qgemv_cuda.py``), and the wiring through real models
with MLX's products and swiglu standing in for it (the same logits, bit for bit).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

from mlx import nn

from gmlx.engine.kernels import cuda_source, qgemv_cuda, swaps

ENV = "GMLX_GLU_KERNEL"
FAMILIES = ("llama", "qwen2", "qwen3")  # their MLP is down(swiglu(gate(x), up(x)))
MAX_ROWS = qgemv_cuda.MAX_ROWS


def enabled() -> bool:
    """Whether ``GMLX_GLU_KERNEL=1`` and MLX runs on CUDA here."""
    return os.environ.get(ENV, "0") == "1" and cuda_source.available()


def layout(mlp: Any) -> tuple[int, int] | None:
    """``(group_size, bits)`` when ``mlp``'s gate and up projections are quantized alike,
    without biases, in a layout the kernel reads; else None."""
    gate, up = mlp.get("gate_proj"), mlp.get("up_proj")
    if not (isinstance(gate, nn.QuantizedLinear) and isinstance(up, nn.QuantizedLinear)):
        return None
    same = (gate.group_size, gate.bits, gate.mode, gate.weight.shape) == (up.group_size, up.bits, up.mode,
                                                                          up.weight.shape)
    k = gate.weight.shape[1] * 32 // gate.bits
    if not same or "bias" in gate or "bias" in up or not qgemv_cuda.supports(1, k, gate.group_size, gate.bits,
                                                                            gate.mode):
        return None
    return gate.group_size, gate.bits


def kernel(mlp: Any) -> Callable[[Any, int], Any]:
    """``gated(x, rows)``: ``swiglu(gate(x), up(x))`` through the kernel, its launch
    worked out once per row bucket (1, 2, 4, 8)."""
    group_size, bits = layout(mlp)
    runs: dict[int, Callable[[Any], Any]] = {}

    def gated(x: Any, rows: int) -> Any:
        bucket = 1 if rows == 1 else 1 << (rows - 1).bit_length()
        run = runs.get(bucket)
        if run is None:
            gate, up = mlp.gate_proj, mlp.up_proj
            run = runs[bucket] = qgemv_cuda.bound(gate.weight, gate.scales, gate.biases, group_size, bits,
                                                  qgemv_cuda.gated_configs(bucket)[0],
                                                  up=(up.weight, up.scales, up.biases))
        return run(x)

    return gated


def mlx_gated(mlp: Any) -> Callable[[Any, int], Any]:
    """What :func:`kernel`'s function computes, in the layers' own products and mlx-lm's
    swiglu (the model's code)."""
    from mlx_lm.models.activations import swiglu

    def gated(x: Any, rows: int) -> Any:
        return swiglu(mlp.gate_proj(x), mlp.up_proj(x))

    return gated


def attach(model: Any, make: Callable[[Any], Callable[[Any, int], Any]] = kernel) -> int:
    """Give ``model``'s llama-pattern MLPs whose gate and up projections the kernel reads
    the fused path for one-token steps of up to eight streams, ``make(mlp)`` building
    it; returns the MLPs changed."""
    classes = _mlp_classes()
    changed = 0
    for _, module in model.named_modules():
        if type(module) in classes and layout(module) is not None:
            module.__class__ = _fused_mlp(type(module))
            object.__setattr__(module, "_gated", make(module))
            changed += 1
    return changed


def detach(model: Any) -> None:
    """Give the MLPs their own classes back."""
    swaps.restore(model, "glu")


@cache
def _mlp_classes() -> frozenset[type]:
    return swaps.family_classes(FAMILIES, "MLP")


@cache
def _fused_mlp(cls: type) -> type:
    """``cls`` whose one-token steps of up to eight streams take the gated product."""
    import mlx.core as mx

    def __call__(self: Any, x: Any) -> Any:
        rows = x.size // x.shape[-1]
        if x.ndim == 3 and x.shape[1] == 1 and rows <= MAX_ROWS and x.dtype in (mx.float16, mx.bfloat16):
            return self.down_proj(self._gated(x, rows))
        return cls.__call__(self, x)

    return swaps.subclass(cls, "glu", __call__)
