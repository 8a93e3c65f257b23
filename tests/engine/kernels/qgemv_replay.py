"""The one-row CUDA-core kernel's arithmetic (``gmlx.engine.kernels.qgemv_cuda``)
replayed in numpy, for the tests: CUDA cannot run on this machine."""

from __future__ import annotations

from typing import Any


def replay(x: Any, w: Any, scales: Any, biases: Any, group_size: int, bits: int) -> Any:
    """The kernel's arithmetic in numpy, for one row: the same chunks, bit windows (a
    code across two words through a 64-bit funnel), the codes as the kernel's floats
    (``0.5 + q / 256`` at 4 and 6 bits, ``q`` at 8) and per-chunk ``s * sum(x q) + b *
    sum(x)`` worked out from them in float32, lanes' partial sums in the same order. For
    the tests, against MLX's own product on the CPU."""
    import numpy as np

    x = np.asarray(x, dtype=np.float32).reshape(-1)
    w = np.asarray(w, dtype=np.uint32)
    s = np.asarray(scales, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32)
    n_rows, k = w.shape[0], x.shape[0]
    chunks = k // 32
    mask = (1 << bits) - 1
    out = np.zeros(n_rows, dtype=np.float32)
    for n in range(n_rows):
        lanes = np.zeros(32, dtype=np.float32)
        for c in range(chunks):
            q = w[n, c * bits:(c + 1) * bits].astype(np.uint64)
            xf = x[c * 32:(c + 1) * 32]
            codes = np.empty(32, dtype=np.float32)
            for j in range(32):
                bit = bits * j
                wi, off = bit // 32, bit % 32
                window = q[wi] | ((q[wi + 1] << np.uint64(32)) if off + bits > 32 else np.uint64(0))
                code = (int(window) >> off) & mask
                codes[j] = code if bits == 8 else np.float32(0.5 + code / 256)
            d = np.zeros(4, dtype=np.float32)
            for j in range(32):
                d[j & 3] = np.float32(d[j & 3] + np.float32(xf[j] * codes[j]))
            dot = np.float32((d[0] + d[1]) + (d[2] + d[3]))
            xs = np.float32(0)
            for j in range(32):
                xs = np.float32(xs + xf[j])
            g = c * 32 // group_size
            if bits == 8:
                share = np.float32(s[n, g] * dot + b[n, g] * xs)
            else:
                share = np.float32(np.float32(256 * s[n, g]) * dot + np.float32(b[n, g] - 128 * s[n, g]) * xs)
            lanes[c % 32] = np.float32(lanes[c % 32] + share)
        # the butterfly of shuffles: lane 0's sum after xor 16, 8, 4, 2, 1
        v = lanes.copy()
        for o in (16, 8, 4, 2, 1):
            v = np.float32(v + v[np.arange(32) ^ o])
        out[n] = v[0]
    return out
