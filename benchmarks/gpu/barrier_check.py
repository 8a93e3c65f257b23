"""What a kernel boundary costs a one-stream step against a barrier inside one kernel, and
whether the next layer's weights loaded before that barrier pay (the GPU machine; no
model file). For issue 19's floor: one stream's step is ~165 launches, and a boundary
cost ~3.3 us on the H100 (12-07: a 14 us stand-in added 17.3 us to a layer), ~0.5 ms of
a ~3 ms step. A kernel that ran several products with a grid-wide barrier between them
(its blocks all resident, each loading its rows of the next product's weights before
it waits) would pay a barrier for each boundary instead, and wait for its weights less.

``LAYERS`` products of ``N x K`` 4-bit weights (groups of 32, float16 scales and biases,
MLX's layout; 10.5 MB a product at 4096 x 4096, the 8B's o-projection), each product's
input the last one's output, timed four ways by the device's clock
(``timing.device_chain_time``), us a product:

- ``launches``: a launch a product (``LAYERS`` launches in a chain, as a step's are);
- ``barrier``: one launch, a grid barrier between products (a counter in global memory,
  each block's first thread adding one and waiting for all; the blocks, ``--blocks``,
  all resident: two of 256 threads an SM);
- ``barrier+prefetch``: the same, each block's rows of the next product's weights copied
  into shared memory (``cp.async``: no registers held) before it waits;
- ``no barrier``: one launch, no barrier (each product reads an input that may not be
  ready: not an answer, the floor of streaming the weights alone).

The barrier's outputs are checked bit for bit against the launches' (the same sums in
the same order). A barrier whose wait runs past ~0.1 s gives up (a bounded spin: a grid
too large to be resident fails the check, it does not hang the GPU).

    python benchmarks/gpu/barrier_check.py [--layers 32] [--n 4096] [--blocks 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gmlx.engine.kernels.timing import device_chain_time, exact_product

GROUP = 32
WARPS = 8  # a block's warps (256 threads)
PAGE = 4096  # uint32s: a counter's array of 16 KB, one of the CUDA allocator's pages
SPIN_LIMIT = 1 << 22  # a barrier's polls (~0.1 s with its pauses) before it gives up

# A block's rows (RPW a warp) of a product are copied into shared memory (``cp.async``, 16
# bytes a copy; each group's scale and bias beside them), x read through L2 into shared
# memory (``__ldcg``: another block wrote it), a lane the words ``lane + 32 j`` of a row (8
# codes a word), a row's sum by shuffles, rounded to half. MODE 0: one product (``layer``
# its index); 1: every product, a barrier between; 2: likewise, the next product's rows
# copied before the barrier and waited for after it; 3: every product, no barrier.
SOURCE = r"""
constexpr int WPL = K / 8 / 32;  // words a lane a row
constexpr int ROWS = RPW * WARPS_;  // a block's rows
__shared__ alignas(16) uint32_t wsh[ROWS][K / 8];  // the block's rows of one product: codes,
__shared__ alignas(16) __half2 sbsh[ROWS][K / GROUP];  // each group's scale and bias,
__shared__ alignas(16) __half xsh[K];  // and its input
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int row0 = blockIdx.x * ROWS;
unsigned* count = const_cast<unsigned*>(counter);
const int first = MODE == 0 ? layer[0] : 0;
const int last = MODE == 0 ? layer[0] + 1 : LAYERS;
// the block's rows of product l into shared memory, 16 bytes a copy, asynchronously (no registers)
auto fetch = [&](int l) {
    for (int i = threadIdx.x; i < ROWS * K / 32; i += blockDim.x) {
        const int r = i / (K / 32), c = i % (K / 32);
        const uint32_t* src = w + ((size_t)l * N + row0 + r) * (K / 8) + c * 4;
        unsigned dst;
        asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(dst) : "l"(&wsh[r][c * 4]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
    }
    for (int i = threadIdx.x; i < ROWS * K / GROUP; i += blockDim.x) {
        const int r = i / (K / GROUP), g = i % (K / GROUP);
        const size_t at = ((size_t)l * N + row0 + r) * (K / GROUP) + g;
        sbsh[r][g] = __halves2half2(scales[at], biases[at]);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
};
auto barrier = [&]() {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned old = atomicAdd(count, 1u);
        const unsigned goal = (old / gridDim.x + 1) * gridDim.x;
        int spins = 0;
        while (*reinterpret_cast<volatile unsigned*>(count) - goal > 0x7fffffffu && ++spins < SPIN_LIMIT)
            __nanosleep(32);  // polled by a load: an atomic poll from every block queues the arrivals behind it
        if (spins >= SPIN_LIMIT) atomicExch(const_cast<unsigned*>(failed), 1u);
        __threadfence();
    }
    __syncthreads();
};
if (MODE == 2) fetch(first);
for (int l = first; l < last; ++l) {
    if (MODE != 2) fetch(l);
    const __half* in = MODE == 0 || l == 0 ? x : out + (size_t)(l - 1) * N;
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x)  // x read through L2: another block wrote it
        reinterpret_cast<uint4*>(xsh)[i] = __ldcg(reinterpret_cast<const uint4*>(in) + i);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    #pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
        const int r = warp * RPW + rr;
        float s = 0.0f;
        #pragma unroll 4
        for (int j = 0; j < WPL; ++j) {
            const int word = lane + 32 * j;
            const uint32_t q = wsh[r][word];
            const __half2 sb = sbsh[r][word * 8 / GROUP];
            const float sc = __low2float(sb), bi = __high2float(sb);
            const uint4 raw = reinterpret_cast<const uint4*>(xsh)[word];
            const __half* xh = reinterpret_cast<const __half*>(&raw);
            #pragma unroll
            for (int e = 0; e < 8; ++e) s += (sc * (float)((q >> (4 * e)) & 15u) + bi) * __half2float(xh[e]);
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) out[(size_t)l * N + row0 + r] = __float2half(s);
    }
    __syncthreads();  // the block's shared rows and x are the next product's
    if (l + 1 < last) {
        if (MODE == 2) fetch(l + 1);
        if (MODE == 1 || MODE == 2) barrier();
    }
}
"""


def kernel(mode: int, layers: int, n: int, k: int, rows_a_warp: int):
    head = (f"constexpr int MODE = {mode}; constexpr int LAYERS = {layers}; constexpr int N = {n}; "
            f"constexpr int K = {k}; constexpr int GROUP = {GROUP}; constexpr int RPW = {rows_a_warp}; "
            f"constexpr int WARPS_ = {WARPS}; "
            f"constexpr int SPIN_LIMIT = {SPIN_LIMIT};\n")
    return mx.fast.cuda_kernel(name=f"gmlx_barrier_check_{mode}_{layers}_{n}_{k}_{rows_a_warp}",
                               input_names=["x", "w", "scales", "biases", "layer", "counter", "failed"],
                               output_names=["out"], source=head + SOURCE, ensure_row_contiguous=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--n", type=int, default=4096, help="a product's outputs and inputs (square: a chain)")
    p.add_argument("--blocks", type=int, default=256, help="blocks of 256 threads (all resident: two an SM)")
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    if mx.default_device().type != mx.DeviceType.gpu or mx.metal.is_available():
        sys.exit("barrier_check needs MLX on CUDA")
    n, layers, blocks = args.n, args.layers, args.blocks
    rpw = n // (blocks * WARPS)
    if rpw not in (1, 2) or rpw * blocks * WARPS != n:
        sys.exit("--n must be 1 or 2 rows a warp of --blocks blocks of 8 warps (a block's rows in 48 KB of shared memory)")
    mx.random.seed(0)
    halves = [mx.random.randint(0, 1 << 16, (layers * n, n // 8)).astype(mx.uint32) for _ in range(2)]
    w = halves[0] | (halves[1] << 16)  # every code 0-15 alike
    # codes 0-15 centred (bias -7.5 steps) and steps ~1/(4.6 sqrt(K)): each product's outputs
    # about as large as its inputs, so 32 in a chain stay finite in half precision
    scales = (mx.random.uniform(0.5, 1.5, (layers * n, n // GROUP)) / (4.6 * n ** 0.5)).astype(mx.float16)
    biases = (-7.5 * scales.astype(mx.float32)).astype(mx.float16)
    x = mx.random.normal((1, n)).astype(mx.float16)
    # the counters and the flag a page each (element 0 used): MLX's CUDA allocator puts arrays
    # of 8 bytes or less in a small pool of managed memory advised read-mostly, where every
    # write invalidates the other processors' copies; the first run's (12-07 16:49) 4-byte
    # counters took ~0.8 ms a barrier
    failed = mx.zeros((PAGE,), mx.uint32)
    counters = {mode: mx.zeros((PAGE,), mx.uint32) for mode in range(4)}  # one a kernel: never shared
    indices = [mx.array([i], mx.int32) for i in range(layers)]
    mx.eval(w, scales, biases, x, failed, *counters.values(), *indices)
    launch = {"grid": (blocks * WARPS * 32, 1, 1), "threadgroup": (WARPS * 32, 1, 1),
              "output_shapes": [(layers, n)], "output_dtypes": [mx.float16]}

    def form(mode: int):
        made = kernel(mode, layers, n, n, rpw)

        def call(v: mx.array) -> mx.array:
            if mode:  # one launch: every product
                return made(inputs=[v, w, scales, biases, indices[0], counters[mode], failed], **launch)[0][-1][None]
            for i in range(layers):  # a launch a product, each reading the last one's output
                v = made(inputs=[v, w, scales, biases, indices[i], counters[0], failed], **launch)[0][i][None]
            return v
        return call

    forms = {"launches": form(0), "barrier": form(1), "barrier+prefetch": form(2), "no barrier": form(3)}
    outs = {name: fn(x) for name, fn in forms.items()}
    mx.eval(*outs.values())
    want = x  # each product in float32 (timing.exact_product), rounded to half as the kernels round theirs
    for i in range(layers):
        rows = slice(i * n, (i + 1) * n)
        want = exact_product(want, w[rows], scales[rows], biases[rows], GROUP, 4).astype(mx.float16)
    scale = mx.abs(want.astype(mx.float32)).max().item()
    for name in ("launches", "barrier", "barrier+prefetch"):
        err = mx.abs(outs[name].astype(mx.float32) - want.astype(mx.float32)).max().item()
        same = mx.array_equal(outs[name], outs["launches"], equal_nan=True).item()
        print(f"{name}: largest difference from the float32 products {err:.3g} (of {scale:.3g})"
              + ("" if name == "launches" else f"; {'the same bits as' if same else 'NOT the same as'} the launches'"))
    mx.eval(failed)
    print(f"a barrier gave up waiting: {'yes (the grid is not all resident)' if failed[0].item() else 'no'}")
    mb = (n * n // 2 + 2 * 2 * n * n // GROUP) / 1e6
    print(f"\n{layers} products of {n}x{n}, 4-bit ({mb:.1f} MB each), {blocks} blocks of {WARPS * 32}, "
          f"{rpw} row(s) a warp; us a product, the device's clock")
    print("| form | us a product | TB/s |")
    print("|---|---:|---:|")
    for name, fn in forms.items():
        seconds = min(device_chain_time(fn, x, args.reps) for _ in range(2)) / (args.reps * layers)
        print(f"| {name} | {seconds * 1e6:.2f} | {mb / 1e6 / seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
