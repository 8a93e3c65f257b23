"""Decode-sized quantized matmuls on tensor cores with wide weight loads (CUDA): ``x @
dequantize(w).T`` for up to 64 rows of ``x``, each weight read once per product, each
lane loading a whole 32-code chunk of a weight row at a time.

Why: on the H200 the tensor-core kernel this one replaced (lane ``t`` of a quad took word
``t`` of each chunk, its scales applied after the product: one 4-byte load of codes, a
2-byte scale and a 2-byte bias per 4 bytes of weights) read an 8B's layers at ~0.3 TB/s
inside a decode step of 32 streams (the step 19.4 ms, its products ~16 ms; the bandwidth
floor of those weights is ~1 ms): too few bytes in flight and too many load instructions
a byte. Here lane ``(g, t)`` of a warp takes chunk
``4q + t`` of quad ``q`` (four consecutive chunks) whole: 16, 24 or 32 bytes (4-, 6-, 8-bit)
in one to three wide loads, and one scale and bias a chunk. ``U`` quads of every one of a
warp's ``FT`` feature tiles are loaded before any is used.

The tensor-core product (``mma.sync m16n8k16``) sums over ``k`` in an order the lanes
choose, but in one call the four lanes of a quad now bring codes of four different
chunks, with four different scales: so each code is dequantized before the product (not
after, per chunk, as the replaced kernel could), in
the activations' half type, two at a time (``MAGIC | lo | hi << 16`` is the pair
``OFF + q`` exactly, ``OFF`` taken off by one fused multiply-add, then ``q * s + b`` by
another, rounded once: the weight MLX's own dequantize makes). 8-bit codes in bf16 (not
exact as ``OFF + q``) are made floats and rounded from float32. In a chunk code ``j``
pairs with code ``j + 4`` of each 8-code group (one shift and mask makes both), ``x``
alike by ``__byte_perm``; a pair is two consecutive ``k`` of the A and B registers of
``mma.sync.m16n8k16`` (PTX ISA's layouts: lane ``(g, t)`` holds A's rows ``g`` and ``g +
8``, columns ``2t, 2t+1`` and ``2t+8, 2t+9``, and B's column ``g``, the same ``k``).

A block of ``WARPS`` warps owns ``16 * FT`` output features and splits the quads between
its warps; their float32 sums meet in shared memory. Gated (``bound(..., up=...)``, for
:mod:`glu_cuda`): the block reads the same features of an MLP's gate and up projections
and writes ``silu(gate) * up``. Parts (``bound(..., more=...)``, for :mod:`qkv_cuda`): two
or three layers of one layout and input (an attention's queries, keys and values), a
block's features all in one of them, each layer written to its own output. ``RT`` tiles of 8 rows cover the
rows of ``x`` (rows past the end read as zeros). ``K`` must be a multiple of 128.

Only built where MLX runs on CUDA (sm_80 and later); Metal and the CPU never reach it.
``tests/engine/kernels/test_qmmw_cuda.py`` replays the lanes' loads, pairing and
registers in numpy, and runs the source itself on the CPU (each block's threads as host
threads, its three PTX instructions emulated: plain, gated and parts, against MLX's
products); the load-time tuner (:mod:`fast_linear`) times it beside MLX's
product and the other kernels and refuses it for any layer where it disagrees.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from gmlx.engine.kernels.cuda_source import build, cuda_type, layer_names, out_shapes
from gmlx.engine.kernels.qmmw_source import BODY, GATED, PLAIN, parts_head

MAX_ROWS = 64
BITS = (4, 6, 8)
GROUPS = (32, 64, 128)
MAX_SHARED_FLOATS = 7 * 8 * 128  # (WARPS - 1) * FT * RT * 128 floats of shared memory

def supports(rows: int, k: int, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether a product of this shape may take the kernel (the tuner still measures)."""
    return (mode == "affine" and bits in BITS and group_size in GROUPS and 1 <= rows <= MAX_ROWS
            and k % 128 == 0 and k % group_size == 0)


def row_tiles(rows: int) -> int:
    """8-row tiles compiled for: 1, 2, 4 or 8 (so few variants compile)."""
    tiles = 1
    while tiles * 8 < rows:
        tiles *= 2
    return tiles


def configs(rows: int, gated: bool = False) -> list[tuple[int, int, int]]:
    """The launch shapes the load-time tuner times: (feature tiles of 16 per block, warps
    per block, quads in flight per warp); ``gated``: a tile of each of two layers per
    feature tile. Each is one more kernel to compile at load."""
    # the shapes that won on the H200 (12-03, an 8B's layouts at 2-64 rows: 1x8x2 and 2x4x2
    # all but once); a gated kernel's first is the one its step kernel takes
    shapes = ((1, 8, 2), (1, 4, 4)) if gated else ((1, 8, 2), (2, 4, 2))
    return [c for c in shapes if fits(rows, c, gated)]


def fits(rows: int, config: tuple[int, ...], gated: bool = False) -> bool:
    """Whether a launch shape's cross-warp sums fit the shared memory allowed."""
    ft, warps = config[0], config[1]
    return (warps - 1) * ft * (2 if gated else 1) * row_tiles(rows) * 128 <= MAX_SHARED_FLOATS


@cache
def _kernel(dtype: Any, scale_dtype: Any, tiles: int, bits: int, group_size: int, ft: int, warps: int,
            unroll: int, gated: bool = False, parts: tuple[int, ...] = ()) -> Any:
    """One kernel per layout, row tiles and launch shape (:mod:`cuda_source` says why);
    ``gated``: the swiglu of two layers' products; ``parts``: the feature counts of two or
    three layers of one layout read in one launch, each written to its own output."""
    import mlx.core as mx

    t, s = cuda_type(dtype), cuda_type(scale_dtype)
    head = (f"using T = {t}; using S = {s}; constexpr int RT = {tiles}; constexpr int BITS = {bits}; "
            f"constexpr int G = {group_size}; constexpr int FT = {ft}; constexpr int WARPS = {warps}; "
            f"constexpr int U = {unroll}; constexpr int BF = {int(dtype == mx.bfloat16)};\n"
            + (GATED if gated else parts_head(parts) if parts else PLAIN))
    layers = 2 if gated else max(1, len(parts))
    inputs, outputs = layer_names(layers, len(parts) or 1)
    kind = "qglumw" if gated else f"qpartsmw{len(parts)}" if parts else "qmmw"
    return build(f"gmlx_{kind}_{t.strip('_')}_{s.strip('_')}_{tiles}_{bits}_{group_size}_{ft}_{warps}_{unroll}",
                 head, BODY, inputs, outputs=outputs)


def bound(w: Any, scales: Any, biases: Any, group_size: int, bits: int,
          config: tuple[int, ...] | None = None, up: tuple[Any, Any, Any] | None = None,
          more: tuple[tuple[Any, Any, Any], ...] = (), heads: tuple[int, ...] = ()) -> Callable[[Any], Any]:
    """The product with this layer's weights as a function of ``x`` alone, its launch
    worked out once per row-tile count (a layer calls it on every decode step); with
    ``up`` (the up projection's weights, scales and biases, of this layer's layout and
    shape) the gated product ``silu(x @ W.T) * (x @ U.T)``; with ``more`` (one or two
    more layers' weights, scales and biases, of this layout and input width, each
    layer's features a multiple of ``16 * FT``) the products of all of them in one
    launch, returned as a tuple; with ``heads`` (a count for each output) one token a
    stream comes out shaped per head (:func:`cuda_source.out_shapes`)."""
    sizes = tuple(a[0].shape[0] for a in ((w,), *more)) if more else ()
    n = sum(sizes) if more else w.shape[0]
    k = w.shape[1] * 32 // bits
    weights = [w, scales, biases, *(up or ()), *(a for layer in more for a in layer)]
    gated = up is not None
    launches: dict[int, tuple[Any, tuple[int, int, int], tuple[int, int, int]]] = {}

    def run(x: Any) -> Any:
        tiles = row_tiles(x.size // k)
        launch = launches.get(tiles)
        if launch is None:
            ft, warps, unroll = config or configs(x.size // k, gated)[0]
            kernel = _kernel(x.dtype, scales.dtype, tiles, bits, group_size, ft, warps, unroll, gated, sizes)
            launch = launches[tiles] = (kernel, (-(-n // (16 * ft)) * 32 * warps, 1, 1), (32 * warps, 1, 1))
        kernel, grid, threadgroup = launch
        outs = kernel(inputs=[x, *weights], grid=grid, threadgroup=threadgroup,
                      output_shapes=out_shapes(x.shape[:-1], sizes or (n,), heads),
                      output_dtypes=[x.dtype] * (len(sizes) or 1))
        return tuple(outs) if more else outs[0]

    return run


def parts_fit(sizes: tuple[int, ...], config: tuple[int, ...]) -> bool:
    """Whether every layer of a parts product is a whole number of a launch's blocks."""
    return all(size % (16 * config[0]) == 0 for size in sizes)


def qmm(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int,
        config: tuple[int, ...] | None = None) -> Any:
    """``x [..., K] @ dequantize(w [N, K*bits/32], scales, biases).T`` -> ``[..., N]``
    on tensor cores, for at most ``MAX_ROWS`` rows in ``x``'s leading dimensions
    (``x`` bf16 or fp16, ``K`` a multiple of 128)."""
    return bound(w, scales, biases, group_size, bits, config)(x)
