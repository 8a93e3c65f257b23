"""One product for the projections that read the same input: attention's q/k/v and an
MLP's gate/up.

A decode step of one stream is host-bound on a GPU: every product is a kernel to build
into the step's graph and launch (on the H200 an 8B's one-stream step took ~10 ms, of
which ~2.6 building the graph and ~4 launching it, for ~225 products and their glue).
Projections that read the same ``x`` with the same layout (bits, group size, float type,
bias or not) can be one product over their weights stacked by rows, its output split by
columns: the same numbers (each output column is the same dot product), one launch for
three or two.

The model's own code is left as it is: each projection is replaced by a
:class:`FusedPart` of one :class:`FusedGroup`, and the first part called with an input
computes the whole product and leaves the other parts theirs, which they take when
called with that same array (``self.q_proj(x), self.k_proj(x), self.v_proj(x)``). A part
called with another input (a model whose projections read different inputs, as
cross-attention's keys do) computes its own rows alone from then on, from the stacked
weights' rows (views: no copy). Only exact ``nn.Linear`` and ``nn.QuantizedLinear``
layers are stacked; a group whose layouts differ stacks the members that share the first
one's layout (a Q4_K_M GGUF's 6-bit ``v_proj`` beside 4-bit ``q_proj``/``k_proj``).
Off unless ``GMLX_FUSE_PROJECTIONS=1``: on the H200 (an 8B in Q4_K_M's layouts, decode
steps timed in process, three leases) it measured 0.96-1.09x at one stream, 0.91-1.04x at
8 and 1.01-1.02x at 32, within the run-to-run noise: the kernels it saves cost the host
about what the split and the parts' Python cost it (benchmarks/RESULTS.md). Kept, tested,
for the backends it is not yet measured on (Metal, where the GPU rather than the host
bounds a step).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from mlx import nn

from gmlx.engine.kernels.fast_linear import FastQuantizedLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# MLX's quantized layer, and CUDA's flattened one (a model whose layers were swapped first)
_QUANTIZED = (nn.QuantizedLinear, FastQuantizedLinear)


class FusedGroup(nn.Module):
    """The stacked layer of a group's projections; ``sizes`` are their output widths in
    order. Holds the product a part computed for the parts not yet called."""

    def __init__(self, layer: nn.Module, sizes: list[int]):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "starts", [sum(sizes[:i]) for i in range(len(sizes))])
        object.__setattr__(self, "split", False)  # set when a part met another input
        object.__setattr__(self, "pending", threading.local())

    def part(self, index: int, x: Any) -> Any:
        """Projection ``index`` of ``x``: from the product of the whole group when the
        parts read one input, else its own rows. (On every layer of every step: kept
        to a few attribute reads, as the graph building is the host's cost this saves.)"""
        pending = self.pending
        held = pending.__dict__.get("x")
        if held is x:
            parts = pending.parts
            out = parts[index]
            if out is not None:
                parts[index] = None
                pending.left -= 1
                if not pending.left:
                    pending.x = pending.parts = None
                return out
        elif held is not None:  # the parts read different inputs
            object.__setattr__(self, "split", True)
            pending.x = pending.parts = None
        if self.split:
            return self._rows(index, x)
        parts = self.whole(x)
        out, parts[index] = parts[index], None
        pending.x, pending.parts, pending.left = x, parts, len(parts) - 1
        return out

    def whole(self, x: Any) -> list[Any]:
        """Every projection of ``x``, from one product."""
        import mlx.core as mx

        return mx.split(self.layer(x), self.starts[1:], axis=-1)

    def _rows(self, index: int, x: Any) -> Any:
        """Projection ``index`` alone, from its rows of the stacked weights."""
        import mlx.core as mx

        a = self.starts[index]
        b = a + self.sizes[index]
        layer = self.layer
        if isinstance(layer, nn.QuantizedLinear):
            biases = layer.get("biases")
            y = mx.quantized_matmul(x, layer["weight"][a:b], layer["scales"][a:b],
                                    None if biases is None else biases[a:b], transpose=True,
                                    group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        else:
            y = x @ layer["weight"][a:b].T
        return y + layer["bias"][a:b] if "bias" in layer else y


class FusedPart(nn.Module):
    """Stands where one projection of a :class:`FusedGroup` stood. The first part holds
    the group (so its weights stay in the parameter tree once); the others reach it
    through a plain attribute."""

    def __init__(self, group: FusedGroup, index: int, holds: bool):
        super().__init__()
        if holds:
            self.group = group
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "index", index)

    def __call__(self, x: Any) -> Any:
        return self._group.part(self.index, x)


def fuse_projections(model: nn.Module) -> str | None:
    """Stack every group of ``model``'s projections that read the same input and share a
    layout; returns the load note, or None when nothing was stacked."""
    import mlx.core as mx

    if os.environ.get("GMLX_FUSE_PROJECTIONS", "0") != "1":
        return None
    stacked = {}
    for _, module in list(model.named_modules()):
        for g, names in enumerate(GROUPS):
            layouts = {n: _layout(module[n]) for n in names if n in module}
            layouts = {n: layout for n, layout in layouts.items() if layout is not None}
            members = [n for n, layout in layouts.items() if layout == next(iter(layouts.values()))]
            if len(members) < 2:
                continue
            layers = [module[n] for n in members]
            group = FusedGroup(_stack(layers), [_out_features(m) for m in layers])
            mx.eval(group.parameters())  # the stacked copy now, so the parts' memory goes as each module is done
            for i, name in enumerate(members):
                module[name] = FusedPart(group, i, holds=i == 0)
            key = (g, "+".join(n.removesuffix("_proj") for n in members))
            stacked[key] = stacked.get(key, 0) + 1
    if not stacked:
        return None
    mx.clear_cache()
    return "stacked projections: " + ", ".join(f"{key} in {n} layer(s)" for (_, key), n in sorted(stacked.items()))


def _layout(layer: Any) -> tuple | None:
    """What must match for two layers to be stacked; None for a layer that is not."""
    if type(layer) in _QUANTIZED:
        return ("q", layer.bits, layer.group_size, layer.mode, layer["weight"].shape[1],
                layer["scales"].dtype, "biases" in layer, "bias" in layer)
    if type(layer) is nn.Linear:
        return ("f", layer["weight"].shape[1], layer["weight"].dtype, "bias" in layer)
    return None


def _out_features(layer: Any) -> int:
    return layer["weight"].shape[0]


def _stack(layers: list[Any]) -> nn.Module:
    """One layer whose weights (and scales, biases, bias) are ``layers``' stacked by rows."""
    import mlx.core as mx

    first = layers[0]
    quantized = type(first) in _QUANTIZED
    if quantized:
        out = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(out)
        out.group_size, out.bits, out.mode = first.group_size, first.bits, first.mode
    else:
        out = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(out)
    for name in ("weight", "scales", "biases", "bias"):
        if name in first:
            out[name] = mx.concatenate([m[name] for m in layers], axis=0)
    if quantized:
        out.freeze()  # as nn.QuantizedLinear leaves itself
    return out
