"""Quantized products of one to eight rows on CUDA cores (a decode step of a few
streams): ``x [rows, K] @ dequantize(w).T`` for MLX's affine 4-, 6- and 8-bit layouts,
bound by reading the weights once at full width.

Why: at one row a decode step is the weights read once, and on the H200 MLX's own
product reads a Llama-3-8B's 4-bit group-32 layers at ~0.8 TB/s (a step's products
~6 ms of GPU time; the host's share of the step is ~3.5 ms), where llama.cpp's whole
step takes ~4 ms. A custom kernel costs MLX's host no more than its own product
(benchmarks/gpu/call_cost.py: 4.4 us a call against 6.3), so the GPU time is what to win.

Layout: a weight row is a little-endian bit stream of codes (code ``k`` at bit
``BITS * k``), a group of ``G`` codes shares a scale ``s`` and a bias ``b``: ``w = s * q +
b``. A 32-code chunk is 16 (4-bit), 24 (6-bit) or 32 (8-bit) bytes, loaded by one lane
in one to three wide loads, so a warp reads 512 to 1,024 contiguous bytes of a row at a
time. Lane ``l`` takes chunks ``l, l + 32, ...`` of each of its warp's ``RPW`` rows; its 32
values of ``x`` are read once per chunk (through L1: every warp reads the same ``x``),
made float, and serve all ``RPW`` rows. A chunk's share is ``s * sum(x q) + b * sum(x)``
in float32. A code becomes a float in one instruction and is used by one FMA: a 4- or
6-bit code as the float ``0.5 + q / 256`` (its byte permuted, or or-ed, under the
exponent of 0.5), so ``sum(x q) = 256 * (sum(x f) - sum(x) / 2)`` (the share then ``256
s * sum(x f) + (b - 128 s) * sum(x)``); an 8-bit code as ``2^23 + q``'s bit pattern minus
``2^23``. The first form took every code through ``2^23 + q`` and a subtract: one
instruction a code more, where 4-bit products were bound by their instructions. The
lanes' sums meet by shuffles. ``WARPS`` warps per block. At one row a lane may load
``DEPTH`` of its chunks (codes, scales, biases and ``x``) before using any: a product of an
8B's 4,096-wide layers is four chunks a lane, so with one in flight at a time most of a
warp's life is waiting on memory (the one-row kernel reached 1.4-1.7 TB/s of the H100's
3.35); the tuner times depth 2 beside depth 1.

With two to eight rows of ``x`` (a second source, ``MAXR`` rows at most, the row count
read from ``x``'s shape) each chunk's codes of every weight row of the warp are made
floats once, and each row of ``x``'s 32 values loaded, made float and summed once, then
taken against every weight row: the same sums per (weight row, row of ``x``) as one
row's; lane 0 writes them. (Its first form loaded and converted ``x`` again for each
weight row: about 32 instructions a code at 8 rows, where this is about half.) New and not yet timed on a GPU: the tuner times it at the 2-, 4- and 8-row
buckets beside MLX's product and the tensor-core kernel, and keeps whichever is fastest.

At one row any of these products (plain, with a residual, gated, of several layers, the
norm folded in or not) may also split each row's K between warps of a block
(:data:`SPLIT`, its sixth number; the tuners time those shapes unless ``GMLX_SPLIT_K=0``), so
a product of few outputs keeps enough warps in flight: see :mod:`qgemv_split`. It may
also stream each warp's weights through shared memory (:data:`qgemv_async.ASYNC`, its
seventh number; ``GMLX_ASYNC=1``), and a 4-bit product rounds x to bytes once a block and
sums its codes four at a time (:mod:`qgemv_q8`; ``GMLX_Q8X=0``: the float sums). (Sums in half pairs,
``GMLX_HALF2``, were tried on 12-07: no faster served, and in sm_90 machine code as long
a loop as the float sums', 587 against 591 instructions a chunk; removed.)

At one row a launch shape may also stage x in the block's shared memory first (its
fifth number, the row tiles a block takes; :data:`STAGED`), so a lane's loads in flight
are the weights' alone (see :mod:`qgemv_source`'s ``_STAGED_SOURCE``); with ``GMLX_STAGED=1`` the load times
those shapes beside the others.

Gated (``bound(..., up=...)``, :mod:`glu_cuda`): both sources also compute an MLP's
``silu(x @ gate.T) * (x @ up.T)`` in one kernel, a warp taking half its rows from each
layer's weights (the same rows of both) and writing the swiglu of each pair.

Only built where MLX runs on CUDA; Metal and the CPU never reach it. The tests replay
its indexing and arithmetic in numpy against MLX's CPU product, and run both sources
themselves on the CPU with CUDA's shuffles and bit instructions emulated
(``tests/engine/kernels/test_qgemv_cuda.py``); ``benchmarks/gpu/gemv_check.py`` checks
the kernel itself against MLX's CPU product on the GPU machine, and the load-time tuner
(``fast_linear``) refuses it for any layer where it disagrees.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

from gmlx.engine.kernels import qgemv_async, qgemv_prepared, qgemv_q8, qgemv_split
from gmlx.engine.kernels.cuda_source import build, cuda_type, layer_names, out_shapes
from gmlx.engine.kernels.qgemv_heads import GATED, GATED_STACKED, PLAIN, RESIDUAL, parts_head
from gmlx.engine.kernels.qgemv_source import (
    ASYNC_BODY,
    ASYNC_NORMED_BODY,
    BODY,
    NORMED_BODY,
    PREPARED_BODY,
    Q8_BODIES,
    Q8_SPLIT_BODIES,
    ROWS_BODY,
    SPLIT_BODY,
    SPLIT_NORMED_BODY,
    STAGED_BODY,
)

BITS = (4, 6, 8)
GROUPS = (32, 64, 128)
MAX_ROWS = 8  # rows of x the few-rows source takes (a bucket of at most 8 streams)

STAGED_BYTES = 48 * 1024  # a block's static shared memory at most: x (2 bytes a value) and its chunks' sums
STAGED_ENV = "GMLX_STAGED"  # 1: the staged shapes timed; else none, and one a load kept runs as its unstaged twin


def staged() -> bool:
    """Whether the staged shapes are timed and taken (``GMLX_STAGED=1``: off by default
    until a served run measures them; see :mod:`qgemv_source`'s ``_STAGED_SOURCE``)."""
    return os.environ.get(STAGED_ENV, "0") == "1"


def stages(k: int) -> bool:
    """Whether the staged shapes are taken (:func:`staged`) and one row of ``k`` values
    fits their shared memory."""
    return staged() and 2 * k + 4 * (k // 32) <= STAGED_BYTES


def unstaged(config: tuple[int, ...]) -> tuple[int, ...]:
    """``config`` without x staged (the same warps, rows a warp and depth)."""
    warps, rpw, max_rows, depth, _, split, rounds = launch_shape(config)
    return (warps, rpw, max_rows, depth) + ((0, split, rounds) if rounds > 1 else (0, split) if split > 1 else ())


def supports(rows: int, k: int, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a product of this shape may take the kernel (the tuner still measures)."""
    return (mode == "affine" and 1 <= rows <= MAX_ROWS and bits in BITS and group_size in GROUPS
            and k % group_size == 0 and k % 32 == 0)


def layout(layer: Any) -> tuple[int, int, str, int, Any] | None:
    """``(group_size, bits, mode, K, scales' dtype)`` of a quantized linear layer without a
    bias whose one-row product the kernel takes (the gated and parts products read
    layers that share one), else None."""
    from mlx import nn

    if not isinstance(layer, nn.QuantizedLinear) or "bias" in layer:
        return None
    mode = getattr(layer, "mode", "affine")
    k = layer.weight.shape[1] * 32 // layer.bits
    if not supports(1, k, layer.group_size, layer.bits, mode):
        return None
    return layer.group_size, layer.bits, mode, k, layer.scales.dtype


# one row, x staged in shared memory: (warps, rows a warp, 1, chunks a lane in flight, row tiles a block)
STAGED = [(8, 2, 1, 1, 1), (8, 2, 1, 2, 2), (8, 4, 1, 1, 2), (16, 2, 1, 2, 1)]
# one row, each row's K split between warps (:data:`qgemv_source.SPLIT_BODY`): (warps, rows
# a group of warps, 1, chunks a lane in flight, 0, warps a group); every product kind,
# the norm folded in or not
SPLIT = [(4, 4, 1, 1, 0, 4), (8, 2, 1, 1, 0, 4), (8, 4, 1, 1, 0, 8), (8, 4, 1, 1, 0, 2), (16, 4, 1, 1, 0, 4)]
SPLIT_ENV = qgemv_split.ENV
splitting = qgemv_split.splitting


def splits(k: int) -> list[tuple[int, ...]]:
    """The split shapes a one-row product of ``k`` values is timed in beside
    :func:`configs`' others (where :func:`splitting`): those whose warps each get at
    least one chunk a lane."""
    if not splitting():
        return []
    return [c for c in SPLIT if k // 32 >= 32 * c[3] * c[5]]


def configs(rows: int = 1, k: int = 0) -> list[tuple[int, ...]]:
    """The launch shapes the load-time tuner times for a bucket of ``rows`` rows: (warps
    per block, weight rows per warp), and for more than one row of x the rows it takes
    at most (the bucket); at one row a fourth, the chunks each lane has in flight
    (``DEPTH``, 1 where absent), and a fifth, the row tiles a block takes with x staged
    in its shared memory (:data:`STAGED`; given ``k``, the row's width, where it fits)."""
    if rows == 1:  # (warps, rows a warp, 1, chunks a lane in flight): the last three, depth 2
        return [(4, 2), (8, 2), (4, 4), (8, 1), (4, 2, 1, 2), (8, 2, 1, 2), (4, 4, 1, 2),
                *(STAGED if k and stages(k) else []), *splits(k), *qgemv_async.shapes(k), *qgemv_q8.deep_shapes(k)]
    return [(4, 1, rows), (4, 2, rows)]  # two: each one compiles at a first load's tuning


def gated_configs(rows: int = 1, k: int = 0) -> list[tuple[int, ...]]:
    """The launch shapes of the gated product (:func:`bound` with ``up``) for a bucket of
    ``rows`` rows: (warps per block, weight rows per warp (half gate, half up), rows of x
    at most[, chunks a lane in flight[, row tiles a block, x staged]]). The first is the
    default; at one row the load times them all (:func:`glu_cuda.tune`)."""
    if rows > 1:
        return [(4, 2, rows)]
    return [(4, 4, 1), (4, 2, 1), (4, 4, 1, 2),
            *([(8, 4, 1, 1, 1), (8, 4, 1, 2, 2), (16, 2, 1, 2, 1)] if k and stages(k) else []),
            *(c for c in [*splits(k), *qgemv_async.shapes(k)] if c[1] % 2 == 0), *qgemv_q8.shapes(gated=True),
            *qgemv_q8.deep_shapes(k)]


@cache
def _kernel(dtype: Any, bits: int, group_size: int, warps: int, rpw: int, max_rows: int = 1,
            gated: bool = False, parts: tuple[int, ...] = (), depth: int = 1, tiles: int = 0, k: int = 0,
            residual: bool = False, eps: float | None = None, split: int = 1,
            rounds: int = 1, prepared: bool = False, q8: bool = False, stacked: bool = False) -> Any:
    """One kernel per layout and launch shape (:mod:`cuda_source` says why); more than
    one row of x (``max_rows``) takes the few-rows source; ``gated``: silu(gate) * up of
    two layers of one layout (``rpw`` even: half its rows each); ``parts``: the row counts
    of two or three layers of one layout read as one, each written to its own output;
    ``depth``: at one row, the chunks a lane loads before using any; ``tiles``: at one
    row, x staged in shared memory (``k`` values) and that many row tiles a block;
    ``residual``: a plain product with one more input, ``res``, added to each output as
    it is written (:data:`qgemv_heads.RESIDUAL`); ``eps``: at one row, unstaged, a plain,
    gated or parts product of ``rms_norm(x, nw, eps)`` with the norm folded in, its weight
    one more input, ``nw`` (:data:`qgemv_source.NORMED_BODY`); ``split``: at one row,
    unstaged, each row's K split between that many warps (:data:`qgemv_source.SPLIT_BODY`);
    ``rounds``: at one unstaged row, K whole, that many rounds of each warp's chunks in
    flight through shared memory (:mod:`qgemv_async`); ``prepared``: with ``eps``, at one
    unstaged row, a chunk a lane at a time, K whole, x's floats made once a block
    (:mod:`qgemv_prepared`, ``k`` values); ``q8``: a 4- or 6-bit product of one unstaged
    row, K whole, x rounded to bytes once a block (:mod:`qgemv_q8`, ``k`` values), ``depth``
    chunks a lane in flight, the norm folded in or not; ``stacked``: a gated or parts
    product whose layers' rows are one array each of weights, scales and biases
    (:mod:`stacked`), three inputs where they were three a layer."""
    if stacked and not (gated or parts):
        raise ValueError("only a gated or parts product reads stacked layers")
    if q8 and (bits == 8 or max_rows > 1 or tiles or rounds > 1 or prepared or (split > 1 and depth > 1)):
        raise ValueError("x is rounded to bytes for a 4- or 6-bit product of one unstaged row only (K split: a chunk"
                         " a lane in flight)")
    if q8 and not qgemv_q8.fits(k, warps, rpw if split > 1 else 0):
        raise ValueError(f"a row of {k} values is not rounded in a block's shared memory")
    if prepared and (eps is None or max_rows > 1 or tiles or split > 1 or rounds > 1 or depth > 1):
        raise ValueError("x is prepared once a block for a normed product of one unstaged row, K whole, only")
    if prepared and not qgemv_prepared.fits(k, warps):
        raise ValueError(f"a row of {k} values is not prepared in a block's shared memory")
    if split > 1 and (max_rows > 1 or tiles or warps % split):
        raise ValueError("K is split between whole groups of a block's warps at one unstaged row only")
    if rounds > 1 and (max_rows > 1 or tiles or split > 1 or depth > 1):
        raise ValueError("the streamed source takes one unstaged row, K whole, a chunk a lane at a time")
    if rounds > 1 and (not qgemv_async.fits(k, group_size) or qgemv_async.shared_bytes(
            warps, rpw, rounds, bits, group_size) > qgemv_async.SHARED_BYTES):
        raise ValueError(f"a row of {k} values in groups of {group_size} at {bits} bits is not streamed at this shape")
    if residual and (gated or parts):
        raise ValueError("a residual is added to a plain product's output only")
    if eps is not None and (residual or max_rows > 1 or tiles):
        raise ValueError("the norm is folded into a product of one unstaged row, without a residual, only")
    t = cuda_type(dtype)
    head = (f"using T = {t}; constexpr int BITS = {bits}; constexpr int G = {group_size}; "
            f"constexpr int WARPS = {warps}; constexpr int RPW = {rpw};"
            + (f" constexpr int MAXR = {max_rows};" if max_rows > 1 else f" constexpr int DEPTH = {depth};")
            + (f" constexpr int TILES = {tiles};" if tiles else "")
            + (f" constexpr int XCHUNKS = {k // 32};" if tiles or prepared or q8 else "")
            + (f" constexpr int SPLIT = {split};" if split > 1 else "")
            + (f" constexpr int STAGES = {rounds};" if rounds > 1 else "")
            + (f" constexpr float EPS = {float(eps)!r}f;" if eps is not None else "")
            + "\n"
            + ((GATED_STACKED if stacked else GATED) if gated else parts_head(parts, stacked) if parts
               else RESIDUAL if residual else PLAIN))
    layers = 1 if stacked else 2 if gated else max(1, len(parts))
    inputs, outputs = layer_names(layers, len(parts) or 1)
    inputs += ["res"] if residual else ["nw"] if eps is not None else []
    kind = ("qglu" if gated else f"qparts{len(parts)}" if parts else "qgemvr" if residual else "qgemv") + (
        "n" if eps is not None else "")
    body = (ROWS_BODY if max_rows > 1 else STAGED_BODY if tiles
            else (Q8_SPLIT_BODIES[eps is not None] if split > 1 else Q8_BODIES[eps is not None, depth > 1]) if q8
            else (PREPARED_BODY if prepared else ASYNC_NORMED_BODY if rounds > 1
                  else SPLIT_NORMED_BODY if split > 1 else NORMED_BODY)
            if eps is not None else ASYNC_BODY if rounds > 1 else SPLIT_BODY if split > 1 else BODY)
    return build(f"gmlx_{kind}_{t.strip('_')}_{bits}_{group_size}_{warps}_{rpw}_{max_rows}"
                 + (f"_d{depth}" if depth > 1 else "") + (f"_x{tiles}" if tiles else "")
                 + (f"_s{split}" if split > 1 else "") + (f"_a{rounds}" if rounds > 1 else "")
                 + ("_p" if prepared else "") + ("_q8" if q8 else "") + ("_st" if stacked else ""),
                 head, body, inputs, outputs=outputs)


def launch_shape(config: tuple[int, ...]) -> tuple[int, int, int, int, int, int, int]:
    """A launch shape of :func:`configs`, :func:`gated_configs`, :data:`SPLIT` or
    :data:`qgemv_async.ASYNC` in full: (warps per block, weight rows per warp (per group
    of warps where K is split), rows of x at most, chunks a lane in flight, row tiles a
    block with x staged (0: not staged), warps that split each row's K (1: none), rounds
    of chunks a warp has in flight through shared memory (1: none))."""
    warps, rpw, *most = config
    return (warps, rpw, most[0] if most else 1, most[1] if len(most) > 1 else 1,
            most[2] if len(most) > 2 else 0, most[3] if len(most) > 3 else 1, most[4] if len(most) > 4 else 1)


def kernel_of(dtype: Any, bits: int, group_size: int, config: tuple[int, ...], gated: bool = False,
              parts: tuple[int, ...] = (), k: int = 0, residual: bool = False, eps: float | None = None,
              stacked: bool = False) -> Any:
    """The kernel for this layout at the launch shape ``config`` (:func:`launch_shape`),
    for rows of ``k`` values (the staged shapes are built for one width)."""
    warps, rpw, max_rows, depth, tiles, split, rounds = launch_shape(config)
    one_row = (max_rows, tiles, rounds) == (1, 0, 1)  # one unstaged row, not streamed
    one_chunk_whole = one_row and (split, depth) == (1, 1)  # K whole, a chunk a lane at a time
    q8 = qgemv_q8.takes(bits, k, warps, depth, one_row, split, rpw)
    prepared = (not q8 and qgemv_prepared.takes(gated) and eps is not None and one_chunk_whole
                and k > 0 and qgemv_prepared.fits(k, warps))
    return _kernel(dtype, bits, group_size, warps, rpw, max_rows, gated, parts, depth, tiles,
                   k if tiles or rounds > 1 or prepared or q8 else 0, residual, eps, split, rounds,
                   prepared, q8, stacked)


def bound(w: Any, scales: Any, biases: Any, group_size: int, bits: int,
          config: tuple[int, ...] | None = None, up: tuple[Any, Any, Any] | None = None,
          more: tuple[tuple[Any, Any, Any], ...] = (), residual: bool = False,
          norm: tuple[Any, float] | None = None, heads: tuple[int, ...] = (),
          stacked: tuple[Any, Any, Any] | None = None) -> Callable[..., Any]:
    """``gemv`` of this layer's weights as a function of ``x`` alone, its launch worked
    out once (a layer calls it on every decode step of one stream); with ``up`` (the up
    projection's weights, scales and biases, of this layer's layout and shape) the gated
    product ``silu(x @ W.T) * (x @ U.T)``, ``config``'s rows per warp then even; with
    ``more`` (one or two more layers' weights, scales and biases, of this layer's layout
    and input width) the products of all of them in one launch, returned as a tuple; with
    ``residual``, a function of ``x`` and ``r`` (the output's shape and type): ``r`` plus
    the product, added as it is written; with ``norm`` (an RMSNorm's weight, of the input's
    type, and epsilon; one row, an unstaged ``config``) the product (gated, or of several
    layers) of ``rms_norm(x)``, the norm in the kernel; with ``heads`` (a count for each
    output) one token a stream comes out shaped per head (:func:`cuda_source.out_shapes`);
    with ``stacked``
    (the weights, scales and biases whose rows are this layer's and then ``up``'s or
    ``more``'s, one array each: :mod:`stacked`) the kernel reads those three arrays in
    their place."""
    sizes = tuple(a[0].shape[0] for a in ((w,), *more)) if more else ()
    n = sum(sizes) if more else w.shape[0]
    config = config or configs()[0]
    k = w.shape[1] * 32 // bits
    if launch_shape(config)[4] and not stages(k):  # turned off (a kept tuning's shape runs unstaged), or too wide
        if staged():
            raise ValueError(f"a row of {k} values does not fit the staged source's shared memory")
        config = unstaged(config)
    warps, rpw, _, _, tiles, split, _ = launch_shape(config)
    outs = rpw // 2 if up is not None else rpw
    grid = (-(-n // (warps // split * outs * max(tiles, 1))) * 32 * warps, 1, 1)
    threadgroup = (32 * warps, 1, 1)
    if stacked is not None and not (up or more):
        raise ValueError("only a gated or parts product reads stacked layers")
    inputs_after_x = ([*stacked] if stacked is not None
                      else [w, scales, biases, *(up or ()), *(a for layer in more for a in layer)])
    eps = None if norm is None else float(norm[1])
    norm_weight = () if norm is None else (norm[0],)  # one more input, after any residual
    kernels: dict[Any, Any] = {}  # per activation dtype

    def run(x: Any, *r: Any) -> Any:
        dtype = x.dtype
        kernel = kernels.get(dtype)
        if kernel is None:
            if norm_weight and norm_weight[0].dtype != dtype:  # (a cast made here could be a trace's placeholder)
                raise ValueError(f"the norm's weight is {norm_weight[0].dtype}, the input {dtype}: they must match")
            kernel = kernels[dtype] = kernel_of(dtype, bits, group_size, config, up is not None, sizes, k, residual,
                                                eps, stacked is not None)
        lead = x.shape[:-1]
        outs = kernel(inputs=[x, *inputs_after_x, *r, *norm_weight], grid=grid, threadgroup=threadgroup,
                      output_shapes=out_shapes(lead, sizes or (n,), heads),
                      output_dtypes=[dtype] * (len(sizes) or 1))
        return tuple(outs) if more else outs[0]

    return run


def gemv(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int,
         config: tuple[int, ...] | None = None) -> Any:
    """``x [..., K] @ dequantize(w [N, K*bits/32], scales, biases).T`` -> ``[..., N]``
    for one row of ``x`` (bf16 or fp16)."""
    return bound(w, scales, biases, group_size, bits, config)(x)
