"""An MLP's gate and up projections and the swiglu between them in one CUDA kernel, for
decode steps of one to 64 streams.

A llama-pattern MLP (llama and the models mlx-lm runs through it, qwen2, qwen3) computes
``down(swiglu(gate(x), up(x)))``: two quantized products and the swiglu, three kernels a
layer, the two products each reading ``x`` and each writing a ``hidden``-wide result
that the swiglu reads back. Where both projections are quantized in one layout (a
Q4_K_M's are both 4-bit), one kernel reads the two layers' rows side by side and writes
``silu(gate) * up`` (:func:`qgemv_cuda.bound` with ``up``: the one-row source at one
stream, the few-rows source at two; :func:`qmmw_cuda.bound` with ``up``, on tensor
cores, at 3-64), rounded as MLX's products and mlx-lm's swiglu round it. llama.cpp's
CUDA decode fuses the same three.

Only built on CUDA; only for one-token steps of at most 64 streams and projections
without biases. Whether a step of 1, 2, 4, ... 64 streams takes it is measured at load
(:func:`tune`, after the quantized layers' own paths): the kernel must agree with MLX's
products and swiglu as closely as they agree with float32 ones, and a whole decode step
of that many streams must get faster with it, or the bucket keeps the three kernels;
the answer is kept with the tuner's (:mod:`tuning`). At one stream the norm before the
MLP folded into the kernel (:func:`fold_norms`) takes it whatever that timing said (a
host-paced step times within its noise there). ``GMLX_GLU_KERNEL=0`` turns it
off, ``=1`` takes it at every bucket untimed (to measure it). The tests run the kernel's
own source on the CPU against MLX's products and swiglu
(``tests/engine/kernels/test_qgemv_cuda.py``), and the wiring and the tuning through
real models with MLX's products and swiglu standing in for it (the same logits, bit for
bit).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from gmlx.engine.kernels import (
    cuda_source,
    qgemv_cuda,
    qgemv_q8,
    qmmw_cuda,
    stacked,
    step_tuning,
    swaps,
)
from gmlx.engine.kernels.fast_linear import plus as product_plus

log = logging.getLogger(__name__)

ENV = "GMLX_GLU_KERNEL"
NORM_ENV = "GMLX_NORM_FOLD"  # 0: the norm before a fused MLP stays MLX's own kernel
FAMILIES = ("llama", "qwen2", "qwen3")  # their MLP is down(swiglu(gate(x), up(x)))
BUCKETS = step_tuning.BUCKETS
MAX_ROWS = step_tuning.MAX_ROWS
bucket = step_tuning.bucket
_shapes: dict[str, tuple[int, ...]] = {}  # the one-row launch shape the load timed fastest, per layer key


def enabled() -> bool:
    """Whether MLX runs on CUDA here and ``GMLX_GLU_KERNEL`` is not ``0``."""
    return os.environ.get(ENV, "auto") != "0" and cuda_source.available()


def layout(mlp: Any) -> tuple[int, int] | None:
    """``(group_size, bits)`` when ``mlp``'s gate and up projections are quantized alike
    (one :func:`qgemv_cuda.layout`, one shape), without biases, in a layout the kernel
    reads; else None."""
    gate, up = mlp.get("gate_proj"), mlp.get("up_proj")
    read = qgemv_cuda.layout(gate)
    if read is None or read != qgemv_cuda.layout(up) or gate.weight.shape != up.weight.shape:
        return None
    return read[0], read[1]


def stackable(model: Any) -> list[Any]:
    """``model``'s MLPs whose gate and up projections the kernel reads (:func:`layout`):
    those :mod:`stacked` may stack."""
    return [m for _, m in model.named_modules() if all(n in m for n in stacked.GATE_UP) and layout(m) is not None]


def kernel(mlp: Any) -> Callable[[Any, Any, int], Any]:
    """``gated(mlp, x, rows)``: ``swiglu(gate(x), up(x))`` through the kernel, its launch
    worked out once per row bucket (1, 2, 4, ... 64), from the source
    :func:`step_tuning.tensor_cores` names; MLX's products and swiglu where the
    tensor-core kernel does not take the layers' input width.
    (The module is passed in, not kept: the function lives on it.)"""
    group_size, bits = layout(mlp)
    runs: dict[int, Callable[[Any], Any] | None] = {}  # None: the bucket takes MLX's products

    def gated(mlp: Any, x: Any, rows: int) -> Any:
        b = bucket(rows)
        if b not in runs:
            gate, up = mlp.gate_proj, mlp.up_proj
            q = (gate.weight, gate.scales, gate.biases, group_size, bits)
            weights = (up.weight, up.scales, up.biases)
            if not step_tuning.tensor_cores(gate, b):
                shape = _shapes.get(_key(mlp), qgemv_cuda.gated_configs(b)[0]) if b == 1 else qgemv_cuda.gated_configs(b)[0]
                runs[b] = qgemv_cuda.bound(*q, shape, up=weights, stacked=stacked.of(mlp, stacked.GATE_UP))
            elif qmmw_cuda.supports(b, gate.weight.shape[1] * 32 // bits, group_size, bits):
                runs[b] = qmmw_cuda.bound(*q, qmmw_cuda.configs(b, gated=True)[0], up=weights)
            else:
                runs[b] = None
        run = runs[b]
        return _mlx_gated(mlp, x, rows) if run is None else run(x)

    return gated


def mlx_gated(mlp: Any) -> Callable[[Any, Any, int], Any]:
    """What :func:`kernel`'s function computes, in the layers' own products and mlx-lm's
    swiglu (the model's code)."""
    return _mlx_gated


def _mlx_gated(mlp: Any, x: Any, rows: int) -> Any:
    from mlx_lm.models.activations import swiglu

    return swiglu(mlp.gate_proj(x), mlp.up_proj(x))


def attach(model: Any, make: Callable[[Any], Callable[[Any, Any, int], Any]] = kernel,
           buckets: Iterable[int] = BUCKETS) -> int:
    """Give ``model``'s llama-pattern MLPs whose gate and up projections the kernel reads
    the fused path for one-token steps of the row ``buckets`` given (:func:`tune`
    decides them at load), ``make(mlp)`` building it; returns the MLPs changed."""
    classes = _mlp_classes()
    changed = 0
    for _, module in model.named_modules():
        if type(module) in classes and layout(module) is not None:
            module.__class__ = _fused_mlp(type(module))
            object.__setattr__(module, "_gated", make(module))
            changed += 1
    use(model, buckets)
    return changed


def use(model: Any, buckets: Iterable[int]) -> None:
    """Let the fused MLPs of ``model`` take the kernel at these row buckets only."""
    chosen = frozenset(buckets)
    for mlp in fused(model):
        object.__setattr__(mlp, "_buckets", chosen)


def fused(model: Any) -> list[Any]:
    """``model``'s MLPs given the fused path."""
    return swaps.marked(model, "glu")


def tune(model: Any) -> str | None:
    """Decide at which row buckets ``model``'s fused MLPs take the kernel
    (:func:`step_tuning.decide`: it agrees with MLX's products and swiglu, and a whole
    decode step gets faster), or read it from an earlier load on this machine; returns the
    load note, None without fused MLPs. ``GMLX_GLU_KERNEL=1``: every bucket, untimed.
    First, where the CUDA-core source takes one row, its launch shape
    (:func:`_time_shapes`)."""
    mlps = fused(model)
    if not mlps:
        return None
    keys = [_key(m) for m in mlps]
    if os.environ.get(ENV) != "1":
        _time_shapes(mlps, keys)
    note = step_tuning.tune(model, ENV, f"gate, up and swiglu in one kernel in {len(mlps)} MLP(s)", mlps, keys,
                            agrees, lambda buckets: use(model, buckets))
    return note  # (taken nowhere, the MLPs stay: fold_norms may still take one stream, and detaches where not)


def _key(mlp: Any) -> str:
    from gmlx.engine.kernels.tuning import layer_key

    gate = mlp.gate_proj
    return layer_key(gate.scales.dtype, gate.weight.shape[1] * 32 // gate.bits, gate.weight.shape[0],
                     *reversed(layout(mlp)))


def _time_shapes(mlps: list[Any], keys: list[str]) -> None:
    """The one-row launch shape of each distinct MLP shape of ``mlps`` (``keys``, one
    each), where the CUDA-core source takes one row: :func:`step_tuning.one_row_shape`
    over every MLP of that shape, as a step reads them (kept on this machine)."""
    members: dict[str, list[Any]] = {}
    for m, key in zip(mlps, keys, strict=True):
        members.setdefault(key, []).append(m)
    for key, alike in members.items():
        if not step_tuning.tensor_cores(alike[0].gate_proj, 1):
            _shapes[key] = _time_shape(key, alike)


def _time_shape(key: str, alike: list[Any]) -> tuple[int, ...]:
    first = alike[0]
    group, bits = layout(first)
    k, dtype = first.gate_proj.weight.shape[1] * 32 // bits, first.gate_proj.scales.dtype

    def calls(shape: tuple[int, ...]) -> list[Any]:
        return [qgemv_cuda.bound(m.gate_proj.weight, m.gate_proj.scales, m.gate_proj.biases, group, bits, shape,
                                 up=(m.up_proj.weight, m.up_proj.scales, m.up_proj.biases)) for m in alike]

    def agrees(call: Any) -> bool:
        return _close(first, step_tuning.tried(lambda x, n: call(x), k, dtype, rows=(1,)))

    shape, timed = step_tuning.one_row_shape(f"{key}:{ENV}:shape", qgemv_cuda.gated_configs(1, k), calls, agrees,
                                             k, bits, dtype)
    log.info("cuda: gate, up and swiglu of %s at one row: launch shape %s (%s)", key, "x".join(map(str, shape)), timed)
    return shape


def agrees(mlp: Any) -> bool:
    """Whether ``mlp``'s fused path gives what MLX's products and swiglu give, as closely
    as those are to float32 products through a float32 swiglu (:func:`timing.agrees`),
    on random rows of input."""
    gate = mlp.gate_proj
    return _close(mlp, step_tuning.tried(lambda x, n: mlp._gated(mlp, x, n), gate.weight.shape[1] * 32 // gate.bits,
                                         gate.scales.dtype, rows=(1, 2, 3, 20)))  # each source, one and four row tiles


def _close(mlp: Any, results: list | None) -> bool:
    """Whether each of ``results`` (:func:`step_tuning.tried`'s) is as close to a float32
    gate, up and swiglu as MLX's products and swiglu are; None (it did not run): no."""
    import mlx.core as mx

    from gmlx.engine.kernels.timing import agrees as close_enough
    from gmlx.engine.kernels.timing import exact_product

    if results is None:
        return False
    for x, n, got in results:
        g, u = (exact_product(x, m.weight, m.scales, m.biases, m.group_size, m.bits) for m in (mlp.gate_proj, mlp.up_proj))
        if not close_enough(got, _mlx_gated(mlp, x, n), g * mx.sigmoid(g) * u, qgemv_q8.tolerance(mlp.gate_proj.bits, n)):
            return False
    return True


def detach(model: Any) -> None:
    """Give the MLPs their own classes back."""
    swaps.restore(model, "glu")


@cache
def _mlp_classes() -> frozenset[type]:
    return swaps.family_classes(FAMILIES, "MLP")


def _takes_gated(mlp: Any, x: Any) -> bool:
    """Whether ``mlp`` (one :func:`attach` fused) takes its gated product for ``x``: a
    one-token step of up to ``MAX_ROWS`` streams in a bucket its load took it at."""
    import mlx.core as mx

    rows = x.size // x.shape[-1]
    return (x.ndim == 3 and x.shape[1] == 1 and rows <= MAX_ROWS and bucket(rows) in mlp._buckets
            and x.dtype in (mx.float16, mx.bfloat16))


def plus(mlp: Any, x: Any, residual: Any) -> Any:
    """``residual + mlp(x)``, the residual added in the down projection's kernel where the
    MLP takes its gated product and the down projection its one-row kernel
    (:func:`fast_linear.plus`); else as the model adds it."""
    if vars(type(mlp)).get("glu") and _takes_gated(mlp, x):  # (fused now: swaps.subclass's marker)
        return product_plus(mlp.down_proj, mlp._gated(mlp, x, x.size // x.shape[-1]), residual)
    return residual + mlp(x)


def normed_plus(mlp: Any, norm: Any, h: Any) -> Any:
    """``h + mlp(norm(h))``: where :func:`fold_norms` gave ``mlp`` its one-row kernel with
    the norm folded in and this is a one-token step of one stream taking the gated
    product, the norm, gate, up and swiglu in one launch (and the residual in the down
    projection's, :func:`plus`); else as :func:`plus` takes it."""
    run = step_tuning.folded(mlp, "_normed", h) if vars(type(mlp)).get("glu") else None
    if run is not None and _takes_gated(mlp, h):
        return product_plus(mlp.down_proj, run(h), h)
    return plus(mlp, norm(h), h)


def fold_norms(model: Any) -> str | None:
    """Give each block whose MLP's gate and up the CUDA-core source takes at one row that
    gated kernel with the block's RMSNorm before it folded in
    (:data:`qgemv_source.NORMED_BODY`), for :func:`normed_plus`, and the gated product at
    one stream with it: at one stream the norm, gate, up and swiglu in one launch where
    MLX's path takes four (the norm, the two products, the swiglu), and the residual in the
    down product's (on the H100, 12-06 evening, the norms alone were 65 kernels of ~3.2 us
    in a 3.27 ms step, each one more for the host to hand over). Untimed, as the q-k-v
    product's fold (:func:`qkv_cuda.fold_norms`): the load's whole-step timing of the
    gated product alone at one stream is the host's and within its noise (12-07 night,
    H100: 1.02x, just under :func:`step_tuning.decide`'s bar, so one stream ran nine
    kernels a layer where it runs five). Each MLP shape's first block is checked: the
    kernel must be as close to a float32 norm, products and swiglu as MLX's norm, products
    and swiglu are, or no block of that shape takes it. ``GMLX_NORM_FOLD=0`` leaves the
    norms as they are. Where no bucket took the gated product and no block folded, the MLPs
    are the model's own again (:func:`detach`; this runs after :func:`tune` at every load).
    Returns the log line (None: no block could take it)."""
    def bind(norm: Any, mlp: Any, weight: Any) -> list[tuple[str, Callable[[Any], Any]]]:
        gate = mlp.gate_proj
        if step_tuning.tensor_cores(gate, 1) or norm.weight.shape != (gate.weight.shape[1] * 32 // gate.bits,):
            return []  # one stream keeps the tensor cores' products, or an odd norm
        group_size, bits = layout(mlp)
        key = _key(mlp)
        shape = qgemv_cuda.unstaged(_shapes.get(key, qgemv_cuda.gated_configs(1)[0]))
        return [(key, qgemv_cuda.bound(gate.weight, gate.scales, gate.biases, group_size, bits, shape,
                                       up=(mlp.up_proj.weight, mlp.up_proj.scales, mlp.up_proj.biases),
                                       norm=(weight, norm.eps), stacked=stacked.of(mlp, stacked.GATE_UP)))]

    try:
        if os.environ.get(NORM_ENV, "1") == "0":
            return None
        line = step_tuning.fold_norms(model, "post_attention_layernorm", "mlp", "glu", "_normed", bind,
                                      _normed_agrees, "the MLP's gate, up and swiglu")
        for mlp in fused(model):  # a folded MLP takes its gated product at one stream, whatever tune() timed there
            if getattr(mlp, "_normed", None) is not None:
                object.__setattr__(mlp, "_buckets", frozenset(mlp._buckets) | {1})
    finally:
        if not any(mlp._buckets for mlp in fused(model)):
            detach(model)  # taken nowhere, folded nowhere: the model's own MLPs, without the check a call
    return line


def _normed_agrees(mlp: Any, norm: Any, run: Callable[[Any], Any]) -> bool:
    """Whether ``run`` (the gated kernel with ``norm`` folded in) is as close to a float32
    norm, products and swiglu as MLX's norm, products and swiglu are, on a random row
    far from unit RMS; False when it does not build or run here."""
    import mlx.core as mx

    from gmlx.engine.kernels.timing import agrees as close_enough
    from gmlx.engine.kernels.timing import exact_norm, exact_product

    gate, up = mlp.gate_proj, mlp.up_proj
    if (ran := step_tuning.tried_far(run, gate, 11)) is None:
        return False
    h, got = ran
    g, u = (exact_product(exact_norm(h, norm), m.weight, m.scales, m.biases, m.group_size, m.bits) for m in (gate, up))
    return close_enough(got, _mlx_gated(mlp, norm(h), 1), g * mx.sigmoid(g) * u, qgemv_q8.tolerance(gate.bits))


@cache
def _fused_mlp(cls: type) -> type:
    """``cls`` whose one-token steps of up to ``MAX_ROWS`` streams take the gated product."""

    def __call__(self: Any, x: Any) -> Any:
        if _takes_gated(self, x):
            return self.down_proj(self._gated(self, x, x.size // x.shape[-1]))
        return cls.__call__(self, x)

    return swaps.subclass(cls, "glu", __call__)
