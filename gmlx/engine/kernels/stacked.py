"""A block's same-layout weights in one array each, for the one-row products that read
them as one (``GMLX_STACKED=1``; off by default until a lease serves it).

Why: a one-stream step on a GPU is paced by its host, and each array a custom kernel
takes costs the host ~1 us a call (``benchmarks/gpu/call_cost.py``, the H100, 12-07: a
kernel of 11 inputs and 3 outputs 18.8-19.7 us a call, one of one of each 7.6-8.6). The
normed q-k-v product of one stream takes the hidden state, three layers' weights, scales
and biases and the norm's weight (11 arrays); the normed gate-up 8. With a block's
layers stacked at load, their rows one after another in one array each of weights,
scales and biases, those kernels take 5: an 8B's step hands over ~9 x 32 arrays fewer.

The layers keep their own arrays as row slices of the stacked ones, which MLX holds as
views of the same memory: nothing is held twice, and every other path (prompts, the
tensor-core products, MLX's own) reads the layers as before. Only where the layers share
a layout (:func:`qkv_cuda.joined`'s three; a gate and up projection of one layout) and
only on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

from gmlx.engine.kernels import cuda_source

ENV = "GMLX_STACKED"
ATTR = "_stacked"  # on the attention or MLP: (weights, scales, biases, the layers' names, their views)


def enabled() -> bool:
    """``GMLX_STACKED=1`` on CUDA (off by default until a lease has served it)."""
    return os.environ.get(ENV, "0") == "1" and cuda_source.available()


def stack(owner: Any, names: tuple[str, ...]) -> None:
    """Stack ``owner``'s quantized layers ``names`` (one layout, one input width): one
    array each of their weights, scales and biases, rows in ``names``' order, kept on
    ``owner``; each layer's own arrays become views of its rows."""
    import mlx.core as mx

    layers = [owner[name] for name in names]
    whole = tuple(mx.concatenate([getattr(layer, part) for layer in layers]) for part in ("weight", "scales", "biases"))
    mx.eval(whole)
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        layer.weight, layer.scales, layer.biases = (a[start:start + rows] for a in whole)
        mx.eval(layer.weight, layer.scales, layer.biases)
        start += rows
    object.__setattr__(owner, ATTR, (*whole, tuple(names), tuple(layer.weight for layer in layers)))


def of(owner: Any, names: tuple[str, ...]) -> tuple[Any, Any, Any] | None:
    """The stacked weights, scales and biases of ``owner``'s layers ``names``, where
    :func:`stack` made them and the layers still read them (not given new arrays since);
    else None."""
    kept = getattr(owner, ATTR, None)
    if kept is None or kept[3] != tuple(names):
        return None
    return kept[:3] if all(owner[name].weight is view for name, view in zip(names, kept[4], strict=True)) else None


GATE_UP = ("gate_proj", "up_proj")
QKV = ("q_proj", "k_proj", "v_proj")


def attach(attentions: list[Any], mlps: list[Any]) -> str | None:
    """Stack the queries, keys and values of ``attentions`` (:func:`qkv_cuda.stackable`) and
    the gate and up projections of ``mlps`` (:func:`glu_cuda.stackable`), before any kernel
    is bound to their arrays (the load calls it where :func:`enabled`); returns the log line
    (None: nothing stacked)."""
    for attention in attentions:
        stack(attention, QKV)
    for mlp in mlps:
        stack(mlp, GATE_UP)
    if not attentions and not mlps:
        return None
    return (f"cuda: the queries, keys and values of {len(attentions)} attention layer(s) and the gate and up of "
            f"{len(mlps)} MLP(s) stacked into one array each")
