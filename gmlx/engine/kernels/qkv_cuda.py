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

from gmlx.engine.kernels import (
    cuda_source,
    qgemv_cuda,
    qgemv_q8,
    qkv_mixed,
    qmmw_cuda,
    stacked,
    step_tuning,
    swaps,
)

log = logging.getLogger(__name__)

ENV = "GMLX_QKV_KERNEL"
NORM_ENV = "GMLX_QKV_NORM"  # 0: at one stream, the norm before them stays MLX's own kernel
NAMES = stacked.QKV
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


def stackable(model: Any) -> list[Any]:
    """``model``'s one-token attention layers whose three projections share one layout
    (:func:`joined`): those :mod:`stacked` may stack."""
    return [a for a in _one_token_layers(model) if joined(a) == NAMES]


def kernel(attention: Any) -> Callable[[Any, Any, int], tuple[Any, Any, Any]]:
    """``project(attention, x, rows)``: the queries, keys and values through one product
    of the :func:`joined` layers (the values through their own layer when not joined),
    its launch worked out once per row bucket, from the source
    :func:`step_tuning.tensor_cores` names; their own products where the tensor-core
    kernel does not take the layers."""
    names = joined(attention)
    shaped = heads(attention)[:len(names)]
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
                runs[b] = qgemv_cuda.bound(*q, shape, more=more, heads=shaped, stacked=stacked.of(attention, names))
            elif (qmmw_cuda.supports(b, first.weight.shape[1] * 32 // first.bits, first.group_size, first.bits)
                  and qmmw_cuda.parts_fit(tuple(m.weight.shape[0] for m in layers), config)):
                runs[b] = qmmw_cuda.bound(*q, config, more=more, heads=shaped)
            else:
                runs[b] = None
        run = runs[b]
        if run is None:
            return _mlx_project(attention, x, rows)
        outs = run(x)
        return outs if len(outs) == 3 else (*outs, attention.v_proj(x))

    return project


def heads(attention: Any) -> tuple[int, int, int]:
    """The head counts of the queries, keys and values: the products write one token a
    stream shaped per head (``(B, heads, 1, D)``), as the attention reads them, so no reshape
    follows them in a step's graph (:func:`cuda_source.out_shapes`)."""
    return attention.n_heads, attention.n_kv_heads, attention.n_kv_heads


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

    shape, timed = step_tuning.one_row_shape(f"{key}:{ENV}:shape", qgemv_cuda.configs(1, k), calls, agrees, k, bits,
                                             dtype)
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
            if not close_enough(g.reshape(w.shape), w, exact_product(x, m.weight, m.scales, m.biases, m.group_size, m.bits),
                                qgemv_q8.tolerance(m.bits, n)):
                return False
    return True


def normed_queries_keys_values(attention: Any, norm: Any, x: Any, offset: Any) -> tuple[Any, Any, Any]:
    """A block's one-token queries, keys and values from its input ``x`` and the norm
    before its attention: where :func:`fold_norms` gave the layer its product with the
    norm folded in and this is one stream, that product (the values' own, normed too,
    where their layout differs); else :func:`one_token.queries_keys_values` of
    ``norm(x)``."""
    from gmlx.engine.kernels import one_token

    if (run := step_tuning.folded(attention, "_normed_project", x)) is not None:
        return one_token.shaped(attention, *run(x), offset)
    return one_token.queries_keys_values(attention, norm(x), offset)


def fold_norms(model: Any) -> str | None:
    """Unless ``GMLX_QKV_NORM=0``: give each one-token attention layer whose queries and
    keys (and values) share a layout the CUDA-core source takes at one row its q-k-v
    product at one stream with the block's RMSNorm folded in
    (:data:`qgemv_source.NORMED_BODY`; where the values' layout differs, all three in one
    launch of two layouts, :mod:`qkv_mixed`, or with ``GMLX_QKV_MIXED=0`` the values through
    a normed product of their own), for :func:`normed_queries_keys_values`: the norm's kernel
    and two products' a layer fewer at one stream, where a step's host hands over each
    kernel. Untimed: the tuner's whole-step timing at one stream did not take the plain
    q-k-v product (H100, 12-06: 0.98x), but served, where the step's host paces it (the
    GPU waited 0.01 ms a step for it), the fold with the rope's in the attention took one
    stream from 230-238 tok/s to 279-282 (12-06 evening). Each shape's first layer is
    checked against MLX's norm and products. Returns the log line (None: off, or no layer)."""
    if os.environ.get(NORM_ENV, "1") == "0":
        return None
    allowed: dict[Callable[[Any], Any], Callable[[int], float]] = {}  # each mixed launch: its parts' shares, by bits

    def bind(norm: Any, attention: Any, weight: Any) -> list[tuple[str, Callable[[Any], Any]]]:
        names = joined(attention)
        if not names or step_tuning.tensor_cores(attention.q_proj, 1):
            return []
        group, bits, _, k, dtype = qgemv_cuda.layout(attention.q_proj)
        v = attention.v_proj
        if norm.weight.shape != (k,) or (len(names) == 2 and (qgemv_cuda.layout(v) or (0,) * 5)[4] != dtype):
            return []
        key = _key(attention)
        shape = qgemv_cuda.unstaged(_shapes.get(key, qgemv_cuda.configs(1)[0]))
        parts = qgemv_cuda.bound(attention.q_proj.weight, attention.q_proj.scales, attention.q_proj.biases, group, bits,
                                 shape, more=tuple((attention[n].weight, attention[n].scales, attention[n].biases)
                                                   for n in names[1:]), norm=(weight, norm.eps),
                                 heads=heads(attention)[:len(names)], stacked=stacked.of(attention, names))
        if len(names) == 3:
            return [(key, parts)]
        values = qgemv_cuda.bound(v.weight, v.scales, v.biases, v.group_size, v.bits, qgemv_cuda.configs(1)[0],
                                  norm=(weight, norm.eps), heads=heads(attention)[2:])

        def apart(h: Any) -> tuple[Any, Any, Any]:
            return (*parts(h), values(h))

        if not qkv_mixed.enabled():
            return [(key, apart)]
        # the values of another layout: in the one launch of both layouts first (keyed by both)
        mixed = qkv_mixed.bound(attention.q_proj, attention.k_proj, v, shape[:4], (weight, norm.eps), heads(attention))
        allowed[mixed] = lambda bits: qkv_mixed.tolerance(bits, shape[:4], k)
        return [(f"{key}+{v.weight.shape[0]}:{v.bits}/{v.group_size}", mixed), (key, apart)]

    def close(attention: Any, norm: Any, run: Callable[[Any], tuple[Any, Any, Any]]) -> bool:
        return _normed_close(attention, norm, run, allowed.get(run, qgemv_q8.tolerance))

    return step_tuning.fold_norms(model, "input_layernorm", "self_attn", "one_token", "_normed_project", bind,
                                  close, "the attention's queries, keys and values")


def _normed_close(attention: Any, norm: Any, run: Callable[[Any], tuple[Any, Any, Any]],
                  tolerance: Callable[[int], float]) -> bool:
    """Whether ``run`` (the projections with ``norm`` folded in) gives each projection as
    close to a float32 norm and product as MLX's norm and the layer's product are, on a
    random row far from unit RMS, beyond that within ``tolerance(bits)`` of its largest
    output (bits: the projection's; what the kernel's part of those bits may add by
    rounding x); False when it does not build or run here."""
    from gmlx.engine.kernels.timing import agrees as close_enough
    from gmlx.engine.kernels.timing import exact_norm, exact_product

    if (ran := step_tuning.tried_far(run, attention.q_proj, 13)) is None:
        return False
    h, got = ran
    for g, w, name in zip(got, _mlx_project(attention, norm(h), 1), NAMES, strict=True):
        m = attention[name]
        if not close_enough(g.reshape(w.shape), w,
                            exact_product(exact_norm(h, norm), m.weight, m.scales, m.biases, m.group_size, m.bits),
                            tolerance(m.bits)):
            return False
    return True
