"""The padded batch's one-query attention kernel on the GPU: does it agree with MLX's
own masked attention (and attention in float32 from its definition), and what does a call cost against
MLX's masked path and MLX's unmasked one-query kernel, at the 8B's attention shape.

    python benchmarks/gpu/attention_check.py            # on the H200 (CUDA only)

Each row: streams, keys (the cache's arrays are longer: the keys are a view, as the
cache hands them over), the largest difference from the float32 attention for the kernel
and for MLX's masked attention, and microseconds per call (100 calls built, then
evaluated together: the host's building and launching included, as in a decode step).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.gemv_check import per_product
from gmlx.engine.kernels import attention_cuda, cuda_source


def inputs(batch: int, keys: int, heads: int, kv_heads: int, d: int, dtype, capacity: int):
    mx.random.seed(batch + keys)
    q = mx.random.normal((batch, heads, 1, d)).astype(dtype)
    k_all = mx.random.normal((batch, kv_heads, capacity, d)).astype(dtype)
    v_all = mx.random.normal((batch, kv_heads, capacity, d)).astype(dtype)
    padding = mx.array([(i * 37) % max(1, keys // 2) for i in range(batch)])
    mask = (padding[:, None, None, None] <= mx.arange(keys)[None]).reshape(batch, 1, 1, keys)
    mx.eval(q, k_all, v_all, mask)
    return q, k_all[..., :keys, :], v_all[..., :keys, :], mask


def reference(q, k, v, scale: float, mask):
    """Attention in float32 from its definition (keys repeated per head group)."""
    qf, kf, vf = (a.astype(mx.float32) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kf, vf = mx.repeat(kf, group, axis=1), mx.repeat(vf, group, axis=1)
    scores = mx.where(mask, (qf @ kf.transpose(0, 1, 3, 2)) * scale, -mx.inf)
    return mx.softmax(scores, axis=-1) @ vf


def main() -> None:
    if not cuda_source.available():
        sys.exit("the kernel is built only on CUDA")
    print(f"device {mx.default_device()}")
    print("| dtype | D | streams | keys | kernel err | MLX masked err | kernel us | MLX masked us | MLX unmasked us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    cases = [(mx.bfloat16, 128, b, keys) for b in (2, 8, 32) for keys in (300, 2100)]
    cases += [(mx.float16, 128, 8, 700), (mx.bfloat16, 64, 8, 700), (mx.bfloat16, 256, 8, 700)]
    for dtype, d, batch, keys in cases:
        heads, kv_heads = (32, 8) if d == 128 else (16, 2)
        q, k, v, mask = inputs(batch, keys, heads, kv_heads, d, dtype, capacity=keys + 200)
        scale = d ** -0.5
        ref = reference(q, k, v, scale, mask)
        assert attention_cuda.supports(q, k, v, mask)
        got = attention_cuda.attend(q, k, v, scale, mask)
        mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        err_k = mx.abs(got.astype(mx.float32) - ref).max().item()
        err_m = mx.abs(mlx.astype(mx.float32) - ref).max().item()
        args = (q, k, v)
        t_k = per_product(lambda a=args, s=scale, m=mask: attention_cuda.attend(*a, s, m), 100)
        t_m = per_product(lambda a=args, s=scale, m=mask: mx.fast.scaled_dot_product_attention(*a, scale=s, mask=m),
                          100)
        t_u = per_product(lambda a=args, s=scale: mx.fast.scaled_dot_product_attention(*a, scale=s), 100)
        print(f"| {str(dtype).removeprefix('mlx.core.')} | {d} | {batch} | {keys} | {err_k:.4f} | {err_m:.4f} "
              f"| {t_k:.1f} | {t_m:.1f} | {t_u:.1f} |", flush=True)


if __name__ == "__main__":
    main()
