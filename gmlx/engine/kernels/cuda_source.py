"""What the custom CUDA kernels share: their constants written into the source.

MLX builds a custom kernel's whole source anew at every call (its header, the signature,
one line per template argument, then the body) before it looks the compiled module up,
so a kernel called a few hundred times a decode step pays for every character and every
template argument, each step. The kernels here are made once per layout and launch
shape instead, their constants in a short head and their body without comments.

MLX keeps compiled kernels on disk across processes under the kernel's name alone
(``MLX_PTX_CACHE_DIR``; gmlx points it into its cache folder), so a name must change
whenever its source does, or a gmlx with a changed kernel would run the old one
(:func:`kernel_name`).

MLX's CUDA back-end also hashes a custom kernel's whole generated source at every
evaluation (the key of its compiled module: the kernel's name and that hash), and gmlx's
one-row products carry 5-9 KB of it: on the H100's host (12-07) the hashing was 9% of the
time of the thread that built and handed over one stream's steps, ~1 us for each of a
step's custom kernels (~130-190 for an 8B). So a kernel's source (its constants and its
code) goes to a file named by its digest (:func:`source_file`, under the cache folder)
and the source MLX keeps is an ``#include`` of that file: NVRTC reads the same text in
the same place, so the code is the same (PTX compared byte for byte,
``benchmarks/gpu/include_check.py``), and the hash covers ~100 bytes. Served on the H100
(12-07, 23:43, two alternating pairs), one stream's hand-over took 1.89-1.98 ms a step
against 2.08-2.16 inline, 328 tok/s against 281-320; one call of an 8 KB kernel 8.0 us
against 10.8. ``GMLX_KERNEL_INCLUDE=0`` keeps every source inline; where the folder
cannot be written (or its path cannot be named in an ``#include``), the source stays
inline too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_INCLUDE = "GMLX_KERNEL_INCLUDE"

_CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def out_shapes(lead: tuple[int, ...], sizes: Sequence[int], heads: Sequence[int] = ()) -> list[tuple[int, ...]]:
    """A product's output shapes: ``(*lead, m)`` for each of its layers' ``sizes``; with
    ``heads`` (a count for each) and one token a stream (``lead`` ``(B, 1)``), ``(B, h, 1,
    m // h)``: the same elements in the same order, shaped per head as the attention reads
    them. The reshape that would follow is then the same shape, which MLX leaves out of the
    graph, where a reshape is a primitive the host hands over at every step (an 8B's
    one-stream step held 96 of them, three a layer, 12-07)."""
    if heads and len(lead) == 2 and lead[1] == 1:
        return [(lead[0], h, 1, m // h) for m, h in zip(sizes, heads, strict=True)]
    return [(*lead, m) for m in sizes]


def cuda_type(dtype: Any) -> str:
    """The CUDA name of an MLX floating dtype (``__half``, ``__nv_bfloat16``, ``float``)."""
    return _CUDA_TYPES[str(dtype).removeprefix("mlx.core.")]


def available() -> bool:
    """Whether MLX runs on CUDA here (the only place gmlx's kernels are built)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu and not mx.metal.is_available()


def compact(source: str) -> str:
    """``source`` without its ``//`` comments and blank lines."""
    lines = (line.split("//")[0].rstrip() for line in source.splitlines())
    return "\n".join(line for line in lines if line.strip())


def kernel_name(prefix: str, source: str) -> str:
    """A custom kernel's name: ``prefix`` and a digest of the whole ``source`` (its
    constants included), so a changed kernel never meets an old one's compiled code."""
    return f"{prefix}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"


def source_file(source: str) -> Path | None:
    """A kernel's ``source`` written (once) to a file named by its digest under the cache
    folder, for an ``#include``; None where it cannot be (a folder not writable, a path with
    a quote, a backslash or a line break in it, which an ``#include "..."`` cannot name)."""
    from gmlx import paths

    folder = paths.cache_dir() / "kernels" / "sources"
    path = folder / f"{hashlib.sha1(source.encode()).hexdigest()}.cuh"
    if not path.is_absolute() or any(c in str(path) for c in '"\\\n'):
        return None
    try:
        if not path.is_file() or path.read_text() != source:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(source)
            tmp.replace(path)  # whole or not at all: another process may read it meanwhile
    except OSError:
        return None
    return path


def kernel_source(source: str, inputs: list[str]) -> str:
    """The source MLX is given for a kernel: an ``#include`` of its file (:func:`source_file`)
    where it could be written, else (or with ``GMLX_KERNEL_INCLUDE=0``) ``source``. The preprocessor
    puts the file's text where the line stands, inside the kernel's function, so NVRTC
    compiles the same code. MLX gives a kernel an input's shape, strides or rank only where
    its source names them (``x_shape``, ``x_strides``, ``x_ndim``): the ones ``source``
    names are named again in a comment beside the ``#include``."""
    if os.environ.get(ENV_INCLUDE) == "0" or (path := source_file(source)) is None:
        return source
    named = sorted({m for m in re.findall(r"\b(\w+_(?:shape|strides|ndim))\b", source)
                    if m.rsplit("_", 1)[0] in inputs})
    return f'#include "{path}"\n' + (f"// {' '.join(named)}\n" if named else "")


def build(prefix: str, head: str, body: str, inputs: list[str], outputs: tuple[str, ...] = ("out",),
          **options: Any) -> Any:
    """The custom kernel of source ``head + body`` (its constants, then its code) with
    ``inputs`` and ``outputs``, named by :func:`kernel_name` (of the whole text, whichever
    way MLX is given it: :func:`kernel_source`); ``options`` go to ``mx.fast.cuda_kernel``
    (``ensure_row_contiguous``)."""
    import mlx.core as mx

    source = head + body
    return mx.fast.cuda_kernel(name=kernel_name(prefix, source), input_names=inputs, output_names=list(outputs),
                               source=kernel_source(source, inputs), **options)


# An MLP's swiglu of a gate and an up product, rounded as MLX's products and mlx-lm's
# swiglu round it (each product to T, then the sigmoid, its product with the gate and
# that with up, each to T): the gated kernels' output.
SWIGLU = """auto gmlx_swiglu = [](float g, float u) -> T {
    const float gf = static_cast<float>(static_cast<T>(g));
    const float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-gf))));
    const float a = static_cast<float>(static_cast<T>(gf * sig));
    return static_cast<T>(a * static_cast<float>(static_cast<T>(u)));
};
"""


def layer_names(layers: int, outputs: int = 1) -> tuple[list[str], tuple[str, ...]]:
    """A quantized kernel's input names for ``x`` and ``layers`` layers' weights (``w,
    scales, biases``, then ``w2...``, ``w3...``) and its ``outputs`` output names (``out``,
    ``out2``, ...)."""
    inputs = ["x", *[f"{name}{i if i > 1 else ''}" for i in range(1, layers + 1) for name in ("w", "scales", "biases")]]
    return inputs, tuple(f"out{i if i > 1 else ''}" for i in range(1, outputs + 1))
