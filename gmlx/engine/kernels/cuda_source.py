"""What the custom CUDA kernels share: their constants written into the source.

MLX builds a custom kernel's whole source anew at every call (its header, the signature,
one line per template argument, then the body) before it looks the compiled module up,
so a kernel called a few hundred times a decode step pays for every character and every
template argument, each step. The kernels here are made once per layout and launch
shape instead, their constants in a short head and their body without comments.

MLX keeps compiled kernels on disk across processes under the kernel's name alone
(``MLX_PTX_CACHE_DIR``; gmlx points it into its cache folder), so a name must change
whenever its source does, or a gmlx with a changed kernel would run the old one
(:func:`kernel_name`)."""

from __future__ import annotations

import hashlib
from typing import Any

_CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


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


def build(prefix: str, head: str, body: str, inputs: list[str], outputs: tuple[str, ...] = ("out",),
          **options: Any) -> Any:
    """The custom kernel of source ``head + body`` (its constants, then its code) with
    ``inputs`` and ``outputs``, named by :func:`kernel_name`; ``options`` go to
    ``mx.fast.cuda_kernel`` (``ensure_row_contiguous``)."""
    import mlx.core as mx

    source = head + body
    return mx.fast.cuda_kernel(name=kernel_name(prefix, source), input_names=inputs, output_names=list(outputs),
                               source=source, **options)


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
