"""Whether the next products' weights fetched into L2 during a latency-bound kernel make a
one-stream layer faster (the GPU machine; no model file).

One stream's step on the H200 runs each layer's attention for ~14.6 us (12-06 night) over
~0.5 MB of cache: the card's memory sits nearly idle while it runs, and the products after
it (the o-proj, 10.5 MB; the gate-up-swiglu, 73.4 MB) then read at 1.5-1.8 TB/s of 4.8,
latency-bound. Here a stand-in for the attention (``SPIN`` blocks that wait ``--spin-us``,
one of them passing x on) launches extra blocks that issue ``prefetch.global.L2`` over the
o-proj's weights and the first ``MB`` of the gate and up projections' (the rows their
first blocks read), and 32 layers of the 8B's one-row products (q-k-v, the stand-in, o,
gate-up-swiglu, down; 4-bit, groups of 32, as gmlx's kernels run them by default) are
timed in a chain by the device's clock (``timing.device_chain_time``), each way.

    python benchmarks/gpu/prefetch_check.py [--layers 32] [--spin-us 14] [--mb 0,16,32,48]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gmlx.engine.kernels import qgemv_cuda
from gmlx.engine.kernels.timing import chain_time, device_chain_time

K, HIDDEN, QKV = 4096, 14336, 6144
G, BITS = 32, 4
SPIN_BLOCKS = 32

# blocks below SPIN_BLOCKS wait ~CYCLES clocks (block 0 passes x on); the rest issue one
# prefetch a LINE bytes over each region's first BYTES_i, a thread at a time, then leave
_SOURCE = r"""
    if (blockIdx.x < SPIN_BLOCKS) {
        const long long t0 = clock64();
        while (clock64() - t0 < CYCLES) {}
        if (blockIdx.x == 0)
            for (int i = threadIdx.x; i < x_shape[1]; i += blockDim.x) out[i] = x[i];
        return;
    }
    const size_t tid = (size_t)(blockIdx.x - SPIN_BLOCKS) * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)(gridDim.x - SPIN_BLOCKS) * blockDim.x * LINE;
    FETCH(w0, BYTES0) FETCH(w1, BYTES1) FETCH(w2, BYTES2) FETCH(w3, BYTES3) FETCH(w4, BYTES4)
    FETCH(w5, BYTES5) FETCH(w6, BYTES6) FETCH(w7, BYTES7) FETCH(w8, BYTES8)
"""
_HINTS = {"last": "prefetch.global.L2::evict_last", "normal": "prefetch.global.L2"}


def stand_in(regions: list[int], cycles: int, blocks: int, line: int, hint: str):
    """The attention's stand-in: ``SPIN_BLOCKS`` waiting ``cycles``, and ``blocks`` more
    prefetching the first ``regions[i]`` bytes of input ``w{i}``."""
    head = (f"constexpr int SPIN_BLOCKS = {SPIN_BLOCKS}; constexpr long long CYCLES = {cycles};"
            f" constexpr size_t LINE = {line};\n"
            + "".join(f"constexpr size_t BYTES{i} = {n};\n" for i, n in enumerate(regions))
            + "#define FETCH(p, n) for (size_t o = tid * LINE; o < (n); o += stride) "
            + f'asm volatile("{_HINTS[hint]} [%0];" :: "l"(reinterpret_cast<const char*>(p) + o));\n')
    kernel = mx.fast.cuda_kernel(name=f"prefetch_{cycles}_{blocks}_{line}_{hint}_{abs(hash(tuple(regions)))}",
                                 input_names=["x", *(f"w{i}" for i in range(9))], output_names=["out"],
                                 header="", source=head + _SOURCE)

    def run(x, weights):
        return kernel(inputs=[x, *weights], output_shapes=[x.shape], output_dtypes=[x.dtype],
                      grid=((SPIN_BLOCKS + blocks) * 128, 1, 1), threadgroup=(128, 1, 1))[0]
    return run


def layer_weights(seed: int, dtype):
    def q(n, k):
        w = (mx.random.normal((n, k), key=mx.random.key(seed * 7 + n + k)) * 0.02).astype(dtype)
        return mx.quantize(w, group_size=G, bits=BITS)
    out = {"qkv": q(QKV, K), "o": q(K, K), "gate": q(HIDDEN, K), "up": q(HIDDEN, K), "down": q(K, HIDDEN)}
    mx.eval(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--spin-us", type=float, default=14.0)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--mb", default="0,16,32,48", help="MB of the gate and up weights fetched (half each)")
    ap.add_argument("--blocks", type=int, default=264)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    layers = [layer_weights(i, dtype) for i in range(args.layers)]
    per_layer = sum(x.nbytes for part in layers[0].values() for x in part)
    run = {name: [qgemv_cuda.bound(*w[name], G, BITS) for w in layers] for name in ("qkv", "o", "down")}
    gated = [qgemv_cuda.bound(*w["gate"], G, BITS, qgemv_cuda.gated_configs(1, K)[0], up=w["up"]) for w in layers]
    cycles = int(args.spin_us * args.clock_ghz * 1e3)
    x0 = (mx.random.normal((1, K)) * 0.5).astype(dtype)
    mx.eval(x0)

    def chain(spin):
        def call(h):
            for i in range(args.layers):
                a = run["qkv"][i](h)[:, :K]
                if spin is not None:
                    a = spin(a, i)
                o = run["o"][i](a)
                g = gated[i](o.reshape(1, 1, K)).reshape(1, HIDDEN)
                h = run["down"][i](g)
            return h
        return call

    def regions(i: int, mb: float) -> list[int]:
        """Bytes fetched of each input: the o-proj's whole, the gate's and up's first rows
        (half of ``mb`` each, their codes, scales and biases alike)."""
        w = layers[i]
        share = min(1.0, mb * 1e6 / 2 / w["gate"][0].nbytes)
        return [a.nbytes for a in w["o"]] + [int(a.nbytes * share) // 16 * 16 for name in ("gate", "up") for a in w[name]]

    def weights(i: int):
        w = layers[i]
        return [*w["o"], *w["gate"], *w["up"]]

    def timed(name: str, spin) -> None:
        call = chain(spin)
        plain = min(chain_time(call, x0, args.reps) for _ in range(2)) / args.reps
        dev = min(device_chain_time(call, x0, args.reps) for _ in range(2)) / args.reps
        print(f"| {name} | {dev * 1e3:.3f} | {dev / args.layers * 1e6:.1f} | {plain * 1e3:.3f} |", flush=True)

    print(f"{args.layers} layers, {per_layer / 1e6:.1f} MB a layer ({per_layer * args.layers / 1e9:.2f} GB: "
          f"{per_layer * args.layers / 4.8e12 * 1e3:.3f} ms at 4.8 TB/s); stand-in {args.spin_us} us "
          f"({cycles} clocks), {args.blocks} prefetch blocks")
    print("| chain | ms (device) | us a layer | ms (chain clock) |\n|---|---:|---:|---:|")
    timed("products alone", None)
    alone = stand_in([0] * 9, cycles, 0, 128, "normal")
    timed("stand-in, no prefetch", lambda a, i: alone(a, weights(i)))
    for hint in ("normal", "last"):
        for line in (128, 32):
            for mb in (float(m) for m in args.mb.split(",")):
                try:
                    kernel = stand_in(regions(0, mb), cycles, args.blocks, line, hint)
                    timed(f"prefetch o + {mb:g} MB gate-up, {hint}, a line of {line}",
                          lambda a, i, kernel=kernel: kernel(a, weights(i)))
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"| {hint} {line} {mb:g}: {type(e).__name__}: {str(e)[:200]} |")


if __name__ == "__main__":
    main()
