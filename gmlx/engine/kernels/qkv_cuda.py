"""An attention's query, key and value projections in one CUDA kernel, for decode steps
of one to 64 streams.

A one-token step (:mod:`one_token`) starts with three products of one input: the queries
(``heads * D`` rows), the keys and the values (``kv_heads * D`` each). The keys' and
values' are small (an 8B's 4096x1024) and run far from the memory's speed on their own
(12-02, the H200: 6-9 us each for 2 MB, where one product over the three stacked, 4096x6144,
took 15.9 us against 27.8 for the three apart). Stacking their weights into one layer
costs a split and, past one stream, copies of the parts; here one kernel reads the three
layers' rows one after another and writes each layer's to its own output
(:func:`qgemv_cuda.bound` with ``more`` at one and two streams, :func:`qmmw_cuda.bound`
with ``more``, on tensor cores, at 3-64), where all three are quantized alike; where the
values' layout differs (a Q4_K_M's 6-bit values in some layers) the queries and keys alone,
the values through their own layer.

Only built on CUDA; only for projections without biases (qwen2's have them: it keeps
its products) and one-token steps of at most 64 streams; where it runs is decided at
load like :mod:`glu_cuda`'s (:mod:`step_tuning`: it must agree with MLX's products, then
make whole steps faster). ``GMLX_QKV_KERNEL=0`` turns it off, ``=1`` takes it at every
bucket untimed. The tests run the kernel's own source on the CPU against MLX's products
(``tests/engine/kernels/test_qgemv_cuda.py``) and the wiring and tuning through real models
with MLX's products standing in for it (the same logits, bit for bit).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from gmlx.engine.kernels import cuda_source, qgemv_cuda, qmmw_cuda, step_tuning, swaps

log = logging.getLogger(__name__)

ENV = "GMLX_QKV_KERNEL"
NAMES = ("q_proj", "k_proj", "v_proj")
_shapes: dict[str, tuple[int, ...]] = {}  # the one-row launch shape the load timed fastest, per layer key


def enabled() -> bool:
    """Whether MLX runs on CUDA here and ``GMLX_QKV_KERNEL`` is not ``0``."""
    return os.environ.get(ENV, "auto") != "0" and cuda_source.available()


def joined(attention: Any) -> tuple[str, ...]:
    """The projections of ``attention`` one product reads: all three, or the queries and
    keys when the values' layout differs; () when not even those two share one."""
    if "q_proj" not in attention or "qkv_proj" in attention:
        return ()
    q, k, v = (qgemv_cuda.layout(attention.get(name)) for name in NAMES)
    if q is None or q != k:
        return ()
    return NAMES if v == q else NAMES[:2]


def kernel(attention: Any) -> Callable[[Any, Any, int], tuple[Any, Any, Any]]:
    """``project(attention, x, rows)``: the queries, keys and values through one product
    of the :func:`joined` layers (the values through their own layer when not joined),
    its launch worked out once per row bucket, from the source
    :func:`step_tuning.tensor_cores` names; their own products where the tensor-core
    kernel does not take the layers."""
    names = joined(attention)
    runs: dict[int, Callable[[Any], Any] | None] = {}  # None: the bucket takes the layers' own products

    def project(attention: Any, x: Any, rows: int) -> tuple[Any, Any, Any]:
        b = step_tuning.bucket(rows)
        if b not in runs:
            first, *others = layers = [attention[name] for name in names]
            q = (first.weight, first.scales, first.biases, first.group_size, first.bits)
            more = tuple((m.weight, m.scales, m.biases) for m in others)
            config = qmmw_cuda.configs(b)[0]
            if not step_tuning.tensor_cores(first, b):
                shape = _shapes.get(_key(attention), qgemv_cuda.configs(b)[0]) if b == 1 else qgemv_cuda.configs(b)[0]
                runs[b] = qgemv_cuda.bound(*q, shape, more=more)
            elif (qmmw_cuda.supports(b, first.weight.shape[1] * 32 // first.bits, first.group_size, first.bits)
                  and qmmw_cuda.parts_fit(tuple(m.weight.shape[0] for m in layers), config)):
                runs[b] = qmmw_cuda.bound(*q, config, more=more)
            else:
                runs[b] = None
        run = runs[b]
        if run is None:
            return _mlx_project(attention, x, rows)
        outs = run(x)
        return outs if len(outs) == 3 else (*outs, attention.v_proj(x))

    return project


def mlx_project(attention: Any) -> Callable[[Any, Any, int], tuple[Any, Any, Any]]:
    """What :func:`kernel`'s function computes, in the layers' own products."""
    return _mlx_project


def _mlx_project(attention: Any, x: Any, rows: int) -> tuple[Any, Any, Any]:
    return attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)


def attach(model: Any, make: Callable[[Any], Callable[[Any, Any, int], Any]] = kernel,
           buckets: Iterable[int] = step_tuning.BUCKETS) -> int:
    """Give ``model``'s one-token attention layers (:mod:`one_token`) whose projections
    :func:`joined` reads as one the one-product path at the row ``buckets`` given
    (:func:`tune` decides them at load), ``make(attention)`` building it; returns the
    layers changed."""
    changed = 0
    for attention in _one_token_layers(model):
        if joined(attention):
            object.__setattr__(attention, "_project", make(attention))
            changed += 1
    use(model, buckets)
    return changed


def detach(model: Any) -> None:
    """Back to three products everywhere."""
    for attention in _one_token_layers(model):
        object.__setattr__(attention, "_project", None)


def use(model: Any, buckets: Iterable[int]) -> None:
    """Let the attached layers of ``model`` take the one product at these buckets only."""
    chosen = frozenset(buckets)
    for attention in projected(model):
        object.__setattr__(attention, "_project_buckets", chosen)


def projected(model: Any) -> list[Any]:
    """``model``'s attention layers given the one-product path."""
    return [a for a in _one_token_layers(model) if a._project is not None]


def _one_token_layers(model: Any) -> list[Any]:
    return swaps.marked(model, "one_token")


def tune(model: Any) -> str | None:
    """Decide at which row buckets the attached layers take the one product
    (:func:`step_tuning.decide`), or read it from an earlier load on this machine;
    returns the load note, None with nothing attached. ``GMLX_QKV_KERNEL=1``: every
    bucket, untimed."""
    layers = projected(model)
    if not layers:
        return None
    if os.environ.get(ENV) != "1":
        _time_shapes(layers)
    note = step_tuning.tune(model, ENV, f"queries, keys and values in one product in {len(layers)} attention layer(s)",
                            layers, [_key(a) for a in layers], agrees, lambda buckets: use(model, buckets))
    if not layers[0]._project_buckets:
        detach(model)  # taken nowhere: three products, without the check a call
    return note


def _key(attention: Any) -> str:
    names = joined(attention)
    group, bits, _, k, dtype = qgemv_cuda.layout(attention.q_proj)
    return f"{dtype}:{k}x" + "+".join(str(attention[n].weight.shape[0]) for n in names) + f":{bits}/{group}"


def _time_shapes(layers: list[Any]) -> None:
    """The one-row launch shape of each distinct projection shape of ``layers``, where
    the CUDA-core source takes one row: :func:`step_tuning.one_row_shape` over every
    layer of that shape, as a step reads them (kept on this machine)."""
    members: dict[str, list[Any]] = {}
    for attention in layers:
        members.setdefault(_key(attention), []).append(attention)
    for key, alike in members.items():
        if not step_tuning.tensor_cores(alike[0].q_proj, 1):
            _shapes[key] = _time_shape(key, alike)


def _time_shape(key: str, alike: list[Any]) -> tuple[int, ...]:
    first = alike[0]
    names = joined(first)
    group, bits, _, k, dtype = qgemv_cuda.layout(first.q_proj)

    def calls(shape: tuple[int, ...]) -> list[Any]:
        return [qgemv_cuda.bound(a.q_proj.weight, a.q_proj.scales, a.q_proj.biases, group, bits, shape,
                                 more=tuple((a[n].weight, a[n].scales, a[n].biases) for n in names[1:])) for a in alike]

    def agrees(call: Any) -> bool:
        return _close(first, step_tuning.tried(lambda x, n: call(x), k, dtype, rows=(1,)))

    shape, timed = step_tuning.one_row_shape(f"{key}:{ENV}:shape", qgemv_cuda.configs(1, k), calls, agrees, k, dtype)
    log.info("cuda: queries, keys and values of %s at one row: launch shape %s (%s)", key, "x".join(map(str, shape)),
             timed)
    return shape


def agrees(attention: Any) -> bool:
    """Whether the one product gives each projection what its own layer gives, as closely
    as that is to a float32 product (:func:`timing.agrees`), on random input rows."""
    q = attention.q_proj
    return _close(attention, step_tuning.tried(lambda x, n: attention._project(attention, x, n),
                                               q.weight.shape[1] * 32 // q.bits, q.scales.dtype,
                                               rows=(1, 2, 3, 20)))  # each source, one and four row tiles


def _close(attention: Any, results: list | None) -> bool:
    """Whether each of ``results`` (:func:`step_tuning.tried`'s: the queries, keys and
    values, or the first two of them) is as close to a float32 product as the layer's
    own is; None (it did not run): no."""
    from gmlx.engine.kernels.timing import agrees as close_enough
    from gmlx.engine.kernels.timing import exact_product

    if results is None:
        return False
    for x, n, got in results:
        for g, w, name in zip(got, _mlx_project(attention, x, n), NAMES, strict=False):
            m = attention[name]
            if not close_enough(g, w, exact_product(x, m.weight, m.scales, m.biases, m.group_size, m.bits)):
                return False
    return True
