"""An attention's queries, keys and values at one stream in one CUDA kernel, the norm
before them folded in, where the values are quantized apart from the queries and keys.

A Q4_K_M GGUF keeps half an 8B's attention values in 6 bits (Q6_K) beside 4-bit queries
and keys. :func:`qkv_cuda.fold_norms` gave such a layer two launches at one stream: the
queries and keys through one normed product (:data:`qgemv_source.NORMED_BODY` with
:func:`qgemv_heads.parts_head`), the values through a normed product of their own. One
launch a layer fewer matters where a served step's host hands each kernel to the GPU
(H100, 12-06 evening: the one-stream step waited on its host again once the GPU's share
shrank, ~8-10 us of host time a kernel). Here one kernel's blocks split in two: the
first ``NB1`` take the queries' and keys' rows in their layout, the rest the values' in
theirs, each part the one-row normed source compiled with its own bits and group size
(each in a scope of its own: the source's ``BITS`` and ``G`` are constants), every warp
normalizing the input itself as the normed source does. The same launch shape (warps,
rows a warp, chunks in flight) serves both parts.

Only on CUDA; checked at load against MLX's norm and products like every folded
product (:func:`qkv_cuda._normed_close`, each part within :func:`tolerance`);
``GMLX_QKV_MIXED=0`` keeps the two launches.
The tests run this source on the CPU (``tests/engine/kernels/test_qkv_mixed.py``) and
compile it for sm_90 (``test_cuda_compile.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from typing import Any

from gmlx.engine.kernels import qgemv_q8, timing
from gmlx.engine.kernels.cuda_source import build, cuda_type, layer_names, out_shapes
from gmlx.engine.kernels.qgemv_cuda import launch_shape
from gmlx.engine.kernels.qgemv_heads import parts_head
from gmlx.engine.kernels.qgemv_source import NORMED_BODY, Q8_BODIES

ENV = "GMLX_QKV_MIXED"
_MACROS = ("ROWS_TOTAL", "ROW_W", "ROW_S", "ROW_B", "OUTPUT", "STORE", "CHUNK")


def enabled() -> bool:
    """Whether ``GMLX_QKV_MIXED`` is not ``0`` (on by default; the load still checks it)."""
    return os.environ.get(ENV, "1") != "0"


def _values_head(rows: int) -> str:
    """The values' part: ``rows`` rows of ``w3``, each written to ``out3``."""
    return (f"#define ROWS_TOTAL {rows}\n"
            "#define ROW_W(r, n) (w3 + (size_t)(n) * words)\n"
            "#define ROW_S(r, n) (scales3 + (size_t)(n) * groups)\n"
            "#define ROW_B(r, n) (biases3 + (size_t)(n) * groups)\n"
            "#define OUTPUT(v, u) static_cast<T>(v)\n"
            f"#define STORE(m, n, v) out3[(size_t)(m) * {rows} + (n)] = (v)\n")


def _scoped(body: str, bits: int, group: int, head: str) -> str:
    """``body`` in a scope of its own with its layout's constants and ``head``'s macros."""
    return (f"{{\n    constexpr int BITS = {bits}; constexpr int G = {group};\n" + head + body
            + "\n" + "".join(f"#undef {m}\n" for m in _MACROS) + "}\n")


def rounded(bits: int, depth: int, k: int, warps: int) -> bool:
    """Whether a part of ``bits``-bit codes rounds x, a row of ``k`` values, to bytes
    (:mod:`qgemv_q8`): with ``GMLX_Q8X=all`` (the default since 12-07 evening: the 8B's
    mixed q-k-v took 12.4 us against 13.5 on an H100, both parts rounded), a chunk a lane
    in flight, where the one-row products would round it (:func:`qgemv_q8.takes`)."""
    return qgemv_q8.trying() and depth == 1 and qgemv_q8.takes(bits, k, warps, depth, whole=True)


def tolerance(bits: int, config: tuple[int, ...], k: int) -> float:
    """What a load allows this kernel's part of ``bits``-bit codes, launched in ``config``
    on a row of ``k`` values, beyond twice MLX's error, as a share of its largest output
    (:func:`timing.agrees`): :data:`qgemv_q8.TOLERANCE` where the part rounds x
    (:func:`rounded`), else MLX's own. Not :func:`qgemv_q8.tolerance`: by default the
    one-row 4-bit products round x, this kernel's 4-bit part does not."""
    warps, _, _, depth, *_ = launch_shape(config)
    return qgemv_q8.TOLERANCE if rounded(bits, depth, k, warps) else timing.TOLERANCE


def source(sizes: tuple[int, int], values: int, layout: tuple[int, int], values_layout: tuple[int, int],
           q8: tuple[bool, bool] = (False, False)) -> str:
    """The kernel's body: the queries' and keys' rows (``sizes``) in ``layout`` (``(bits,
    group)``) by the first ``NB1`` blocks, the ``values`` rows in ``values_layout`` by the
    rest; the input ``x`` normalized by the weight ``nw`` (``EPS``) in both; ``q8``: which
    part rounds x to bytes once a block (:mod:`qgemv_q8`; ``XCHUNKS`` in the head)."""
    first, second = (Q8_BODIES[True, False] if rounds else NORMED_BODY for rounds in q8)
    for old, new in (("blockIdx.x", "(blockIdx.x - NB1)"), ("w_shape", "w3_shape")):
        if second.count(old) != 1:
            raise AssertionError(f"the normed one-row source changed: {old!r} is not there once")
        second = second.replace(old, new)
    return ("if (blockIdx.x < NB1) " + _scoped(first, *layout, parts_head(sizes))
            + "else " + _scoped(second, *values_layout, "constexpr int OUTS = RPW;\n" + _values_head(values)))


def blocks(rows: int, warps: int, rpw: int) -> int:
    """Blocks of ``warps`` warps, ``rpw`` rows a warp, that cover ``rows`` rows."""
    return -(-rows // (warps * rpw))


@cache
def _kernel(dtype: Any, layout: tuple[int, int], values_layout: tuple[int, int], warps: int, rpw: int, depth: int,
            sizes: tuple[int, int], values: int, eps: float, k: int = 0) -> Any:
    """One kernel per pair of layouts, launch shape and sizes (``k``, the row's width:
    where a part rounds x to bytes, :func:`rounded`)."""
    t = cuda_type(dtype)
    q8 = tuple(rounded(bits, depth, k, warps) for bits in (layout[0], values_layout[0]))
    head = (f"using T = {t}; constexpr int WARPS = {warps}; constexpr int RPW = {rpw}; "
            f"constexpr int DEPTH = {depth}; constexpr float EPS = {float(eps)!r}f; "
            f"constexpr int NB1 = {blocks(sum(sizes), warps, rpw)};"
            + (f" constexpr int XCHUNKS = {k // 32};" if any(q8) else "") + "\n")
    inputs, outputs = layer_names(3, 3)
    name = (f"gmlx_qkvmixed_{t.strip('_')}_{layout[0]}_{layout[1]}_{values_layout[0]}_{values_layout[1]}"
            f"_{warps}_{rpw}" + (f"_d{depth}" if depth > 1 else "") + (f"_q{q8[0]:d}_q{q8[1]:d}" if any(q8) else ""))
    return build(name, head, source(sizes, values, layout, values_layout, q8), [*inputs, "nw"], outputs=outputs)


def bound(queries: Any, keys: Any, values: Any, config: tuple[int, ...], norm: tuple[Any, float],
          heads: tuple[int, ...] = ()) -> Callable[[Any], Any]:
    """``(q, k, v)`` of one row ``h`` as a function of ``h`` alone: the three quantized
    layers' products of ``rms_norm(h, *norm)`` in one launch, the queries and keys of one
    layout, the values of another (their input width the same); ``config`` a one-row
    launch shape (:func:`qgemv_cuda.configs`), unstaged; with ``heads`` (a count for each
    output) shaped per head (:func:`cuda_source.out_shapes`)."""
    warps, rpw, _, depth, tiles, split, rounds = launch_shape(config)
    if tiles or split > 1 or rounds > 1:
        raise ValueError("the mixed q-k-v product takes unstaged, unstreamed launch shapes, K whole, only")
    layout = (queries.bits, queries.group_size)
    if (keys.bits, keys.group_size) != layout:
        raise ValueError("the queries and keys must share a layout")
    sizes = (queries.weight.shape[0], keys.weight.shape[0])
    n = values.weight.shape[0]
    grid = ((blocks(sum(sizes), warps, rpw) + blocks(n, warps, rpw)) * 32 * warps, 1, 1)
    weights = [a for layer in (queries, keys, values) for a in (layer.weight, layer.scales, layer.biases)]
    kernels: dict[Any, Any] = {}

    def run(x: Any) -> tuple[Any, Any, Any]:
        kernel = kernels.get(x.dtype)
        if kernel is None:
            if norm[0].dtype != x.dtype:
                raise ValueError(f"the norm's weight is {norm[0].dtype}, the input {x.dtype}: they must match")
            kernel = kernels[x.dtype] = _kernel(x.dtype, layout, (values.bits, values.group_size), warps, rpw, depth,
                                                sizes, n, float(norm[1]), queries.weight.shape[1] * 32 // queries.bits)
        lead = x.shape[:-1]
        return tuple(kernel(inputs=[x, *weights, norm[0]], grid=grid, threadgroup=(32 * warps, 1, 1),
                            output_shapes=out_shapes(lead, (*sizes, n), heads), output_dtypes=[x.dtype] * 3))

    return run
