"""Quantized layers on CUDA: every product's rows flattened, and a faster path per row
bucket where one measures faster.

First, every quantized layer hands MLX its input as ``(rows, K)`` (a decode step's
``(streams, 1, K)`` makes MLX's CUDA product read every weight once per stream: see
:class:`FastQuantizedLinear`). Then every distinct (in, out, bits, group) shape of the
model's affine quantized layers is timed at each row bucket a decode step can have (1,
2, 4, 8, 16, 32, 64 rows), at short prefills' sizes (128 and 256 rows) and at a long
prefill chunk's (``LARGE`` rows, for every product over 256 rows) four ways: MLX's
``quantized_matmul``, ``qgemv_cuda`` (one or two rows: CUDA cores, the weights read in
wide loads; at one row 1.3-1.75x MLX's product on an 8B's large layers on the H200), ``qmmw_cuda.qmm`` (the
tensor-core kernel, bf16 and fp16 activations, up to 64 rows) and ``dequantized`` (dequantize, then a dense matmul: at
prefill sizes it is MLX's float prefill plus one pass over the weights, a cost that does
not shrink with the rows: on the H200 it made an 8B's 2k-token prefill 2.1x faster and a
128-token prompt's first token slower, 231 against 139 ms, while one bucket covered
every prefill, hence the three). A bucket takes the fastest path that agrees with a
float32 product as closely as MLX's own does. A product timed alone is not a decode step,
though (a custom kernel's call costs the host more than MLX's own product: MLX
rebuilds its source at every call, and a step has hundreds of them; on the H200 the
one-row path first cost ~2 ms of host a step, ~1 ms once its source and launch were
fixed per layer), so each bucket's choices are then confirmed on the whole model: a decode
step of that many streams (past 64 rows, a prefill), timed with and without them, and
the bucket goes back to MLX's path unless its step got faster. Timing every path also
compiles it, before the model reports ready. The decisions are kept per machine
(:mod:`gmlx.engine.kernels.tuning`), so a later load of the same shapes times nothing.
``GMLX_QMV_KERNEL=0`` leaves the layers as they are (to measure MLX's own path),
``GMLX_QMV_KERNEL=flat`` only flattens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from mlx import nn

from gmlx.engine.kernels import (
    cuda_source,
    qgemv_async,
    qgemv_cuda,
    qgemv_q8,
    qmmw_cuda,
    timing,
    traces,
)
from gmlx.engine.kernels.tuning import Paths, Tuning, layer_key, model_key

LARGE = 512  # the bucket every product of more than 256 rows (a long prefill chunk) takes
COLD_BYTES = 256 << 20  # weights a product's timing passes through (past the GPU's L2 cache)
SLOPED_ROWS = 64  # buckets timed by a call's slope (timing.per_call); larger ones by their runs' totals
GEMV_ROWS = 2  # the CUDA-core kernels' buckets (products and step kernels): past them tensor cores won on the H200
MAX_KEPT_ROWS = 64  # decode steps of at most this many streams keep their worked-out call
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, LARGE)
log = logging.getLogger(__name__)
MLX = "mlx"
KERNEL = "kernel"
GEMV = "gemv"
DENSE = "dense"


def bucket(rows: int) -> int:
    """The row bucket a product of ``rows`` rows takes its path from: the power of two
    at or above ``rows``, and ``LARGE`` past 256."""
    if rows > LARGE // 2:
        return LARGE
    power = 1
    while power < rows:
        power *= 2
    return power


def dequantized(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int) -> Any:
    """``x @ dequantize(w).T`` through MLX's dequantize and a dense matmul."""
    import mlx.core as mx

    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    return x @ dense.astype(x.dtype).T


class FastQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear that hands MLX its input as ``(rows, K)``, and whose products of
    a row bucket in ``paths`` take that path (the kernel with the launch shape it was
    timed fastest at).

    A decode step's activations are ``(streams, 1, K)``; for that shape MLX's CUDA
    quantized matmul runs ``streams`` one-row products, each reading every weight
    again (on the H200 an 8B Q4_K_M decode step took 51 ms at 8 streams and 172 ms at
    32, while the same products timed alone with ``x`` as ``(rows, K)`` add up to about
    8 and 12 ms): so the rows are flattened first, which changes nothing but the
    kernel MLX picks. (MLX's Metal product already counts every leading dimension as
    rows.)"""

    # Set by ``set_paths`` when a layer is swapped to this class: a plain attribute, not
    # one of the module's children (a dict set the usual way would join its parameter
    # tree), and read on every call.
    paths: Paths

    def set_paths(self, paths: Paths) -> None:
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "launches", {})  # the kernels' launches, bound per (path, config)
        object.__setattr__(self, "by_shape", {})  # a decode-sized input's whole call, per (shape, dtype)

    def _launch(self, chosen: tuple[str, tuple[int, ...]]) -> Callable[[Any], Any]:
        launch = self.launches.get(chosen)
        if launch is None:
            path, config = chosen
            q = (self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
            if path == GEMV:
                launch = qgemv_cuda.bound(*q, config)
            elif path == KERNEL:
                launch = qmmw_cuda.bound(*q, config)
            else:
                launch = lambda x: dequantized(x, *q)
            self.launches[chosen] = launch
        return launch

    def __call__(self, x: Any) -> Any:
        # Every layer of every decode step comes here, and a step of a few streams is bound
        # by the host: a decode-sized input's whole call (path, launch, bias) is worked out
        # once per shape and kept (``by_shape``), so a step pays one lookup a layer.
        key = (x.shape, x.dtype)
        call = self.by_shape.get(key)
        if call is None:
            call = self._call_for(x)
            if x.size <= MAX_KEPT_ROWS * x.shape[-1] and (x.ndim < 3 or x.shape[-2] == 1):
                self.by_shape[key] = call  # a decode step's: prefill shapes vary with every prompt
        return call(x)

    def plus(self, x: Any, residual: Any) -> Any:
        """``residual + self(x)``: where ``x``'s rows take the one-row kernel's path (and
        the layer has no bias, ``GMLX_RESIDUAL_KERNEL`` not ``0``, the load's check
        passed: :func:`_check_residuals`), one launch that adds
        ``residual`` as it writes each output, with the bits MLX's add of the product
        would give (:data:`qgemv_heads.RESIDUAL`); else the product and MLX's add. A
        block's attention output and MLP down projections add its input this way: an
        operation and a kernel fewer each, 64 of an 8B's step at one stream."""
        chosen = self._chosen(x)
        if (chosen is None or chosen[0] != GEMV or "bias" in self or residual.shape != (*x.shape[:-1], self["weight"].shape[0])
                or residual.dtype != x.dtype or not residual_enabled() or not getattr(self, "residual_ok", True)):
            return residual + self(x)
        key = ("residual", chosen)
        launch = self.launches.get(key)
        if launch is None:
            launch = self.launches[key] = qgemv_cuda.bound(self["weight"], self["scales"], self["biases"],
                                                           self.group_size, self.bits, chosen[1], residual=True)
        return launch(x, residual)

    def _chosen(self, x: Any) -> tuple[str, tuple[int, ...]] | None:
        """The path (and launch shape) ``x``'s rows take: their bucket's, or None (MLX's product)."""
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        return self.paths.get(bucket(rows)) if self.paths else None

    def _call_for(self, x: Any) -> Callable[[Any], Any]:
        """What a call with ``x``'s shape runs: the chosen path's launch (plus the bias),
        or MLX's product with the rows flattened."""
        chosen = self._chosen(x)
        if chosen is None:
            product = super().__call__
            shape = x.shape
            if len(shape) <= 2 or x.size == shape[-2] * shape[-1]:  # rows already (see _by_rows)
                return product
            return lambda x: _by_rows(product, x)
        launch = self._launch(chosen)
        if "bias" not in self:
            return launch
        bias = self["bias"]
        return lambda x: launch(x) + bias


def residual_enabled() -> bool:
    """Whether :meth:`FastQuantizedLinear.plus` adds a residual in the one-row kernel
    (``GMLX_RESIDUAL_KERNEL=0``: never, MLX's add after the product)."""
    return os.environ.get("GMLX_RESIDUAL_KERNEL", "1") != "0"


def plus(layer: Any, x: Any, residual: Any) -> Any:
    """``residual + layer(x)``, in one launch where ``layer`` can (:meth:`FastQuantizedLinear.plus`)."""
    return layer.plus(x, residual) if isinstance(layer, FastQuantizedLinear) else residual + layer(x)


class FlatQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose use as the output layer (tied weights) hands MLX its
    input as ``(rows, K)``, for the reason :class:`FastQuantizedLinear` gives."""

    def as_linear(self, x: Any) -> Any:
        return _by_rows(super().as_linear, x)


def _by_rows(product: Callable[[Any], Any], x: Any) -> Any:
    """``product(x)`` with ``x`` handed over as ``(rows, K)`` when it holds more than one
    sequence (one sequence reaches MLX as rows already, and is passed as it is)."""
    shape = x.shape
    if len(shape) <= 2 or x.size == shape[-2] * shape[-1]:
        return product(x)
    return product(x.reshape(-1, shape[-1])).reshape(*shape[:-1], -1)


def use_fast_kernels(model: nn.Module) -> str | None:
    """On CUDA, swap the model's quantized layers to :class:`FastQuantizedLinear` (and
    :class:`FlatQuantizedEmbedding`), with the paths that measured faster; returns the
    load note, or None when there is nothing to do. ``GMLX_QMV_KERNEL=0`` leaves the
    model as it is; ``GMLX_QMV_KERNEL=flat`` only flattens (no tuning)."""
    mode = os.environ.get("GMLX_QMV_KERNEL", "1")
    if mode == "0" or not cuda_source.available():
        return None
    modules = [m for _, m in model.named_modules()]
    for m in modules:
        if type(m) is nn.QuantizedLinear:
            m.__class__ = FastQuantizedLinear
            m.set_paths({})
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = FlatQuantizedEmbedding
    traces.retrace(model)  # compiled blocks traced before trace these layers as they are now
    flat = sum(isinstance(m, FastQuantizedLinear | FlatQuantizedEmbedding) for m in modules)
    if not flat:
        return None
    layers = [m for m in modules if isinstance(m, FastQuantizedLinear) and any(kernels.supports(
        1, _in_features(m), m.group_size, m.bits, getattr(m, "mode", "affine")) for kernels in (qgemv_cuda, qmmw_cuda))]
    note = f"cuda: {flat} quantized layer(s) take their input as (rows, K)"
    if mode == "flat" or not layers:
        return note
    start = time.perf_counter()
    decided = _tune(model, layers)
    return f"{note}; {decided} ({time.perf_counter() - start:.1f} s)"


def _tune(model: nn.Module, layers: list[FastQuantizedLinear]) -> str:
    """Give ``layers`` the paths that measured faster and made the whole step faster;
    returns what was decided, for the load note."""
    import mlx.core as mx

    tuning = Tuning()
    chosen: dict[tuple[int, int, int, int], Paths] = {}
    keys: dict[tuple[int, int, int, int], str] = {}
    alike: dict[tuple[int, int, int, int], list[FastQuantizedLinear]] = {}
    for m in layers:
        alike.setdefault(_key(m), []).append(m)
    for m in layers:
        if (key := _key(m)) not in chosen:
            # a tuning kept under the default choices is not one with the chain's, staged, split or streamed shapes' (or x rounded)
            keys[key] = (layer_key(m.scales.dtype, *key) + ("" if _queued() else ":chain")
                         + (":staged" if qgemv_cuda.staged() else "")
                         + (":split" if qgemv_cuda.splitting() else "")
                         + (":async" if qgemv_async.streaming() else "")
                         + qgemv_q8.key(m.bits))  # (6- and 8-bit layers: their own)
            known = tuning.layer(keys[key])
            if known is None:
                started = time.perf_counter()
                known = _measure(m, alike[key][1:])
                log.info("cuda: %s's paths timed in %.1f s", keys[key], time.perf_counter() - started)
                tuning.set_layer(keys[key], known)
            chosen[key] = known
    swapped = [m for m in layers if chosen[_key(m)]]
    for m in swapped:
        m.set_paths(dict(chosen[_key(m)]))
    whole = model_key((keys[_key(m)] for m in layers), form=traces.step_form(model))
    confirmed = tuning.confirmed(whole)
    if confirmed is None:
        confirmed = _confirm(model, swapped, sorted({r for p in chosen.values() for r in p}))
        tuning.set_confirmed(whole, confirmed)
    tuning.save()
    mx.clear_cache()  # the timing's temporaries (dequantized weights among them)
    chosen = {key: {r: c for r, c in paths.items() if r in confirmed} for key, paths in chosen.items()}
    for m in swapped:
        m.set_paths(dict(chosen[_key(m)]))
    _check_residuals(alike, chosen)
    traces.retrace(model)
    swapped = [m for m in swapped if m.paths]
    summary = "; ".join(
        f"{k}x{n} {bits}-bit: " + (", ".join(f"{r}:{p}" + ("x".join(map(str, c)) if p in (KERNEL, GEMV) else "")
                                             for r, (p, c) in sorted(paths.items())) or "mlx")
        for (k, n, bits, _), paths in chosen.items())
    steps = ", ".join(f"{r}: {t:.2f}x" for r, t in confirmed.items()) or "none faster"
    return (f"decode-sized paths on {len(swapped)} of {len(layers)} ({summary}); "
            f"whole-step speed-up by rows: {steps}")


def _check_residuals(alike: dict[tuple, list[FastQuantizedLinear]], chosen: dict[tuple, Paths]) -> None:
    """For each layer shape whose paths take the one-row kernel, that kernel with a
    residual added as it writes (:meth:`FastQuantizedLinear.plus`) against the same
    product plus MLX's add, on one layer of the shape, at each such row bucket: it must
    give the same bits, or no layer of the shape adds its residual that way (logged). A
    wrong kernel must not serve a token."""
    import mlx.core as mx

    if not residual_enabled():
        return
    for key, paths in chosen.items():
        buckets = [r for r, (path, _) in paths.items() if path == GEMV]
        layer = alike[key][0]
        if not buckets or "bias" in layer:
            continue
        dtype = layer.scales.dtype
        try:
            for rows in buckets:
                x = mx.random.normal((rows, 1, key[0])).astype(dtype)
                r = mx.random.normal((rows, 1, key[1])).astype(dtype)
                if not mx.array_equal(layer.plus(x, r), r + layer(x)).item():
                    raise RuntimeError(f"at {rows} row(s) it differs from the product plus MLX's add")
        except Exception as error:  # noqa: BLE001 - a kernel MLX refused, or one that disagreed
            log.warning("cuda: %dx%d %d-bit layers add their residuals after the product: %s", key[0], key[1], key[2],
                        str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
            for m in alike[key]:
                object.__setattr__(m, "residual_ok", False)


def dense_scratch_bytes(model: nn.Module) -> int:
    """Bytes of the largest weight a product of ``model`` dequantizes (its layers on the
    dense path at any row bucket): scratch the capacity model prices."""
    return max((_in_features(m) * m.weight.shape[0] * m.scales.dtype.size
                for _, m in model.named_modules()
                if isinstance(m, FastQuantizedLinear) and any(p == DENSE for p, _ in m.paths.values())),
               default=0)


def _in_features(layer: Any) -> int:
    return layer.weight.shape[1] * 32 // layer.bits


def _key(layer: Any) -> tuple[int, int, int, int]:
    return (_in_features(layer), layer.weight.shape[0], layer.bits, layer.group_size)


def _measure(layer: Any, alike: Sequence[Any] = (), reps: int = 20) -> Paths:
    """The row buckets where a path beat MLX's quantized matmul on this layer: which path,
    and for a kernel the launch shape (of its module's ``configs``) it was fastest at.
    Each timing runs its products over this layer's and ``alike``'s weights in turn (the
    model's other layers of the same shape), as many as it takes to pass ``COLD_BYTES``: a step reads each layer once,
    from memory, where one layer's product repeated finds its weights in the GPU's L2
    cache (50 MB on the H200: a Llama-3-8B's 4-bit MLP layer is 33 MB), which flatters a
    kernel that reads them more than once. The products are queued, independent of each
    other (:func:`timing.queue_time`), the way every served measurement that went well
    timed them; with ``GMLX_PRODUCT_TIMING=chain``, in a chain, each product's input the
    last one's output (:func:`timing.chain_time`), as a step's products follow each
    other (independent products queued together may run at once on a GPU, which flatters
    a kernel that fills few of its SMs: the attention's timing takes the chain for that
    reason). Why the queue stays the default: the one lease that served the chain's
    choices (H100, 12-06, with the other 12-06 additions) decoded one stream at 176 tok/s
    where the queue's had served 276 (12-05), the cause not yet isolated
    (``lease.sh bisect``). Up to :data:`SLOPED_ROWS` rows a path's time is a call's, the
    slope between runs of ``reps`` and four times as many (:func:`timing.per_call`: a
    run's own cost left out, as large as the differences between launch shapes). The paths
    within a margin of the fastest are timed again in turn (:func:`timing.runoff`)."""
    import mlx.core as mx

    k = _in_features(layer)
    g, bits = layer.group_size, layer.bits
    weights = [(m.weight, m.scales, m.biases) for m in [layer, *alike]]
    size = sum(a.nbytes for a in weights[0])
    weights = weights[:max(1, -(-COLD_BYTES // size))]
    reps = max(reps, len(weights))
    args = weights[0]
    paths: Paths = {}
    for rows in BUCKETS:
        x = mx.random.normal((rows, k)).astype(layer.scales.dtype)
        products: dict[tuple[str, tuple[int, ...]], Callable[..., Any]] = {
            (MLX, (0, 0)): lambda x, *w: mx.quantized_matmul(x, *w, transpose=True, group_size=g, bits=bits),
            (DENSE, (0, 0)): lambda x, *w: dequantized(x, *w, g, bits),
        }
        if qmmw_cuda.supports(rows, k, g, bits) and x.dtype in (mx.bfloat16, mx.float16):
            for config in qmmw_cuda.configs(rows):
                products[(KERNEL, config)] = lambda x, *w, c=config: qmmw_cuda.qmm(x, *w, g, bits, config=c)
        if qgemv_cuda.supports(rows, k, g, bits) and rows <= GEMV_ROWS and x.dtype in (mx.bfloat16, mx.float16):
            for config in qgemv_cuda.configs(rows, k):
                products[(GEMV, config)] = lambda x, *w, c=config: qgemv_cuda.gemv(x, *w, g, bits, config=c)
        exact = timing.exact_product(x, *args, g, bits)
        want = products[(MLX, (0, 0))](x, *args)
        def timed(fn: Callable[..., Any], x: Any = x, rows: int = rows) -> float:
            def run(n: int) -> float:
                if _queued():
                    return timing.queue_time(timing.cycling(fn, x, weights), n)
                return timing.chain_time(timing.chained(fn, weights), x, n)

            # decode-sized: a call's time without the run's own (timing.per_call); a prompt's: the run's
            return timing.per_call(run, reps) if rows <= SLOPED_ROWS else run(reps) / reps

        times = {name: timed(fn) for name, fn in products.items()
                 if name[0] == MLX or timing.runs_and_agrees(
                     timing.cycling(fn, x, weights[:1]), want, exact,
                     qgemv_q8.tolerance(bits, rows) if name[0] == GEMV else timing.TOLERANCE)}
        # MLX's product again, last: timed first, on a GPU still speeding up, it would lose
        mlx_again = timed(products[(MLX, (0, 0))])
        times[(MLX, (0, 0))] = min(times[(MLX, (0, 0))], mlx_again)
        for name in timing.runoff(times):  # the close ones again, in turn
            times[name] = min(times[name], timed(products[name]))
        best = min(times, key=lambda name: times[name])
        if best[0] != MLX:
            paths[rows] = best
    return paths


def _queued() -> bool:
    """Whether the products are timed as a queue of independent calls (the default; see
    :func:`_measure`), not in a chain (``GMLX_PRODUCT_TIMING=chain``, kept under keys of
    their own), to measure the two against each other."""
    return os.environ.get("GMLX_PRODUCT_TIMING", "queue") != "chain"


def _confirm(model: nn.Module, swapped: list[Any], buckets: list[int]) -> dict[int, float]:
    """The buckets whose chosen paths make the model's whole decode step faster, with the
    speed-up (each timed with and without them; the layers' ``paths`` as they were)."""
    kept: dict[int, float] = {}
    for rows in buckets:
        saved = {id(m): m.paths[rows] for m in swapped if rows in m.paths}

        def use(taken: bool, rows: int = rows, saved: dict = saved) -> None:
            for m in swapped:
                if id(m) in saved:
                    if taken:
                        m.paths[rows] = saved[id(m)]
                    else:
                        m.paths.pop(rows, None)
            _forget_calls(swapped)

        started = time.perf_counter()
        try:
            without, with_paths = timing.step_times(model, rows, use)
            log.info("cuda: whole steps of %d rows with and without their paths: %.2fx (%.1f s)", rows,
                     without / with_paths, time.perf_counter() - started)
        except (TypeError, ValueError, RuntimeError):  # a model this cannot step: keep MLX's
            use(True)
            with_paths, without = 1.0, 0.0
        if with_paths < 0.98 * without:
            kept[rows] = without / with_paths
    return kept


def _forget_calls(layers: list[Any]) -> None:
    """Drop the calls ``layers`` worked out per shape (their ``paths`` changed)."""
    for m in layers:
        m.by_shape.clear()


