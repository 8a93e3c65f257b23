"""The padded batch's one-query attention kernel on the GPU: does it agree with MLX's
own masked attention (and attention in float32 from its definition), and what does a call cost against
MLX's masked path and MLX's unmasked one-query kernel, at the 8B's attention shape.

    python benchmarks/gpu/attention_check.py            # on the H200 (CUDA only)
    python benchmarks/gpu/attention_check.py --cached   # the cached variant only
    python benchmarks/gpu/attention_check.py --whole    # the whole step compiled, only
    python benchmarks/gpu/attention_check.py --fixed    # where a short cache's call goes

``--cached``: the variant that writes a step's keys and values into the cache in place
(``cached_attention_cuda.attend_cached``) against the cache's own writes and MLX's attention:
its largest difference, whether the cache arrays after it are the old ones with the one
position replaced, bit for bit, and nothing else; and its us per call beside MLX's
one-query attention, up to a 32k-position cache at one stream (each head's keys split
over several blocks there), each form apart: whole, split, in each layout, and whole with
the head split (``hsplit`` the group: a block a query head, the column the load's choice
of head split is to be read against). ``--reps N``: N calls a timing instead of 100 (under ``ncu``,
whose per-launch GPU times leave the host's share out: lease.sh's ``prepare``);
``--marked`` launches a marker kernel before each timing (``kernel_times``' windows), and
``--ncu-csv FILE --reps N`` reads ncu's CSV of such a run back into the same table in GPU
microseconds a call. ``--whole``: a small float16 llama
(head size 128) decoding a padded batch through the cached variant with the whole
one-token step one compiled call (``whole_step``) against the same without it: the
largest logit difference, the greedy tokens and the caches, over a growth of the cache.
``--fixed``: where the in-place attention's ~17 us a call at a short cache goes (the 8B's
shape, one stream, chained, us a call): the whole form over 38 keys, over none (every
position padding: its start and end alone, the cache still written), with the rope
folded in; a kernel of the same launch that only reads the positions and writes the
output (the launch's floor in a chain); MLX's one-query attention. With ``--device``
each call is the device's part alone (each chain behind a lead product:
``timing.device_chain_time``), where the chain's clock is the host's for a short cache.

Each row: streams, keys (the cache's arrays are longer: the keys are a view, as the
cache hands them over), the largest difference from the float32 attention for the kernel
and for MLX's masked attention, and microseconds per call (100 calls in a chain, each call's queries the last one's
output, built before the clock starts and evaluated together, as a step's layers run:
calls that do not depend on each other run at once on the GPU and would time a kernel of
a few blocks as if it filled it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.gemv_check import CLOCK, calls_a_product, per_product
from benchmarks.gpu.kernel_times import kernel_table, marker
from gmlx.engine.kernels import (
    attention_cuda,
    cached_attention_cuda,
    cached_attention_load,
    cuda_source,
)
from gmlx.engine.kernels.timing import device_chain_time


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


# (dtype, head size, streams, cache capacity, write position) of each row of the cached table
CASES = ((mx.bfloat16, 128, 1, 256, 37), (mx.bfloat16, 128, 1, 512, 130), (mx.bfloat16, 128, 32, 512, 300),
         (mx.bfloat16, 128, 8, 512, 300), (mx.float16, 128, 32, 2304, 2100), (mx.bfloat16, 64, 4, 256, 255),
         (mx.bfloat16, 128, 1, 2304, 2100), (mx.bfloat16, 128, 1, 8192, 8000), (mx.bfloat16, 128, 1, 32768, 32000),
         (mx.bfloat16, 128, 8, 8192, 8000))
VARIANTS = ("as launched", "warp whole", "warp split", "lane whole", "lane split", "MLX unmasked", "MLX masked",
            "warp whole, a query head a block")
MARKED = "--marked" in sys.argv
UNTIMED = 9000  # windows from here hold launches no timing made


def timed(window: int, fn, x, reps: int) -> float:
    """``per_product``: us a call of ``fn`` (the queries ``x`` in) in a chain of ``reps``,
    each call's queries the last one's output (independent calls queued together run at
    once on the GPU, and time a kernel that fills a few SMs as if it filled them all);
    after a marker kernel opening ``window`` under ``--marked``."""
    if MARKED:
        marker(window)
    return per_product(fn, x, reps)


def ncu_table(path: Path, reps: int) -> None:
    """The cached table's timings from ncu's CSV of a ``--marked`` run: for each row and
    variant, GPU microseconds a call (every kernel launched in its window, over the
    window's calls: ``gemv_check.calls_a_product``) and each kernel's share."""
    calls = calls_a_product(reps)
    table = kernel_table(path, 1)
    print("| row (dtype, D, streams, capacity, at) | variant | GPU us a call | kernels (us a launch x launches a call) |")
    print("|---|---|---:|---|")
    for window in sorted(w for w in table if 0 <= w < UNTIMED):
        case, variant = CASES[window // len(VARIANTS)], VARIANTS[window % len(VARIANTS)]
        kernels = table[window]
        total = sum(us for us, *_ in kernels.values()) / calls
        parts = ", ".join(f"{re.sub(r'_[0-9a-f]{12}$', '', name).removeprefix('gmlx_')[:48]} {us / n:.1f} "
                          f"x {n / calls:.2g}"
                          for name, (us, n, *_) in sorted(kernels.items(), key=lambda kv: -kv[1][0]))
        dtype, d, batch, capacity, at = case
        print(f"| {str(dtype).removeprefix('mlx.core.')}, {d}, {batch}, {capacity}, {at} | {variant} | {total:.1f} "
              f"| {parts} |")


def check_cached(reps: int = 100) -> bool:
    """The cached variant against a cache's own writes and MLX's masked attention, and
    us per call against MLX's unmasked one-query attention over the same keys (what
    mlx-lm runs for one unpadded stream) and its masked one; long caches split each
    head's keys over several blocks (``splits``). ``reps`` calls a timing (a few under
    ncu, which times each launch on the GPU's own clock: the host left out)."""
    print("| dtype | D | streams | write at | splits | err vs MLX warp / lane / head split | cache as written | padding "
          "| kernel us | warp whole us | warp whole, a query head a block us | warp split us (splits) | lane whole us "
          "| lane split us | MLX unmasked us | MLX masked us |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    good = True
    for index, (dtype, d, batch, capacity, at) in enumerate(CASES):
        heads, kv_heads = (32, 8) if d == 128 else (16, 2)
        mx.random.seed(capacity + at)
        q = mx.random.normal((batch, heads, 1, d)).astype(dtype)
        k_new, v_new = (mx.random.normal((batch, kv_heads, 1, d)).astype(dtype) for _ in range(2))
        k, v = (mx.random.normal((batch, kv_heads, capacity, d)).astype(dtype) for _ in range(2))
        padding = mx.array([(i * 37) % max(1, at // 2) for i in range(batch)], dtype=mx.int32)
        scale = d ** -0.5
        lane = cached_attention_cuda.fits(heads // kv_heads, d, "lane")
        if MARKED:
            marker(UNTIMED + index)  # the checks' launches, apart from any timing's window
        err, written = cached_attention_load.agreement(q, k_new, v_new, k, v, padding, at, scale, layout="warp")
        err_lane, written_lane = (cached_attention_load.agreement(q, k_new, v_new, k, v, padding, at, scale,
                                                                  layout="lane") if lane else (err, written))
        group = heads // kv_heads  # the head split: each key-value head's query heads a block each
        err_head, written_head = cached_attention_load.agreement(q, k_new, v_new, k, v, padding, at, scale, n=1,
                                                                 layout="warp", hsplit=group)
        good &= written and err < 0.05 and written_lane and err_lane < 0.05 and written_head and err_head < 0.05
        position = mx.array([at], dtype=mx.int32)
        w = index * len(VARIANTS)
        rest = (k_new, v_new, k, v, padding, position)
        t_k = timed(w, lambda x, a=rest, s=scale: cached_attention_cuda.attend_cached(x, *a, s), q,
                    reps)  # writes the same position again
        # the same with every head's keys in one block (no split, no combine), and split
        # toward the target whatever the length (where a split starts to pay), in each layout
        n = cached_attention_cuda.splits(batch * kv_heads, capacity, 0)
        t_whole, t_split, t_lane_whole, t_lane_split = (
            timed(w + 1 + i, lambda x, a=rest, s=scale, parts=parts, layout=layout:
                  cached_attention_cuda.attend_cached(x, *a, s, n=parts, layout=layout), q, reps)
            if layout == "warp" or lane else float("nan")
            for i, (layout, parts) in enumerate((lay, p) for lay in ("warp", "lane") for p in (1, n)))
        t_head = timed(w + 7, lambda x, a=rest, s=scale, g=group:
                       cached_attention_cuda.attend_cached(x, *a, s, n=1, layout="warp", hsplit=g), q, reps)
        kv = (k[..., :at + 1, :], v[..., :at + 1, :])  # the keys so far, the step's written in (``written``)
        mask = (padding[:, None, None, None] <= mx.arange(at + 1)[None]).reshape(batch, 1, 1, at + 1)
        t_u = timed(w + 5, lambda x, a=kv, s=scale: mx.fast.scaled_dot_product_attention(x, *a, scale=s), q, reps)
        t_m = timed(w + 6, lambda x, a=kv, s=scale, m=mask:
                    mx.fast.scaled_dot_product_attention(x, *a, scale=s, mask=m), q, reps)
        print(f"| {str(dtype).removeprefix('mlx.core.')} | {d} | {batch} | {at} "
              f"| {cached_attention_cuda.splits(batch * kv_heads, capacity)} | {err:.4f} / {err_lane:.4f} / "
              f"{err_head:.4f} | {written and written_lane and written_head} | {padding.tolist()[:4]} | {t_k:.1f} "
              f"| {t_whole:.1f} | {t_head:.1f} | {t_split:.1f} ({n}) "
              f"| {t_lane_whole:.1f} | {t_lane_split:.1f} | {t_u:.1f} | {t_m:.1f} |", flush=True)
    for heads, kv_heads, d in () if MARKED else ((32, 8, 128), (12, 2, 128)):  # the 8B's and the 1.5B's, as a load times them
        cached_attention_load.compile_shape(heads, kv_heads, d, d ** -0.5, mx.bfloat16)  # as a load checks it
        print(f"\nthe load's timing: {cached_attention_load.tune_split(heads, kv_heads, d, d ** -0.5, mx.bfloat16)}",
              flush=True)
    return good


def check_whole() -> bool:
    """A padded batch decoding through the whole compiled step against the blocks alone."""
    from mlx_lm.models import llama

    from gmlx.engine.kernels import compiled_blocks, one_token, whole_step
    from gmlx.engine.prompt_cache import _AlignedBatchKVCache

    args = llama.ModelArgs(model_type="llama", hidden_size=1024, num_hidden_layers=4, intermediate_size=2048,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           rope_theta=5e5, tie_word_embeddings=False)
    mx.random.seed(3)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    one_token.attach(model, rotation=lambda attention: None, in_place=True)
    compiled_blocks.attach(model)
    prompts = mx.array([[5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [0, 0, 0, 7, 7, 8, 8, 9, 3, 2], [0] * 6 + [2, 4, 6, 8]])

    def decode(n: int = 24):
        cache = [_AlignedBatchKVCache([0, 3, 6]) for _ in model.layers]
        for c in cache:
            c.step = 8  # grows three times in the steps below: traced again each time
        out = [model(prompts, cache=cache)[:, -1:]]
        for _ in range(n):
            out.append(model(mx.argmax(out[-1], axis=-1), cache=cache))
        mx.eval(out)
        return out, cache

    want, want_cache = decode()
    assert whole_step.attach(model)
    got, got_cache = decode()
    took = model._whole_step is not None and not model._whole_off
    err = max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() for a, b in zip(want, got))
    tokens = all(mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item() for a, b in zip(want, got))
    used = want_cache[0]._idx
    same = all(mx.array_equal(a.keys[..., :used, :], b.keys[..., :used, :]).item()
               and mx.array_equal(a.values[..., :used, :], b.values[..., :used, :]).item()
               for a, b in zip(want_cache, got_cache))
    print(f"whole step: taken {took}, largest logit difference {err:.5f}, the same greedy tokens {tokens}, "
          f"the same caches {same} ({used} positions)")
    return took and tokens and err < 0.05


_FLOOR_BODY = """
const int b = blockIdx.x / (gridDim.x / q_shape[0]);
const int at = position[0] + padding[b];
if (threadIdx.x < D) out[(size_t)blockIdx.x * D + threadIdx.x] = q[(size_t)blockIdx.x * D + threadIdx.x] + static_cast<T>(at & 1);
"""


def check_fixed(reps: int = 100) -> None:
    """``--fixed``: the in-place attention's call taken apart (one stream of the 8B's
    shape, bf16, chained), at 38 keys and at ~1,000: each layout as built by default, with
    fewer keys in flight and built for dense rows alone (less code: whether a launch
    fetching its 41-68 KB of code is the ~17 us it costs at any length), over no keys at
    all, with the rope folded in; the wide form (a query head a block of 32 warps,
    :func:`cached_attention_cuda.wide_threads`), plain and with the rope folded in, and
    in each launch shape of :func:`cached_attention_cuda.wide_shapes` as served; a
    kernel of the same launch that only reads the positions; MLX's one-query attention."""
    from mlx import nn

    from gmlx.engine.kernels import rope_cuda

    heads, kv_heads, d, capacity = 32, 8, 128, 1280
    mx.random.seed(3)
    q = mx.random.normal((1, heads, 1, d)).astype(mx.bfloat16)
    k_new, v_new = (mx.random.normal((1, kv_heads, 1, d)).astype(mx.bfloat16) for _ in range(2))
    k, v = (mx.random.normal((1, kv_heads, capacity, d)).astype(mx.bfloat16) for _ in range(2))
    scale, live = d ** -0.5, mx.array([0], dtype=mx.int32)
    rope = nn.RoPE(d, base=500000.0)
    inv, _ = rope_cuda.inverse_frequencies(rope, d)
    floor = cuda_source.build("gmlx_launch_floor", f"using T = {cuda_source.cuda_type(mx.bfloat16)}; constexpr int D = {d};\n",
                              _FLOOR_BODY, ["q", "padding", "position"], ensure_row_contiguous=False)
    mx.eval(q, k_new, v_new, k, v, inv)
    builds = [("warp", 0, False), ("warp", 2, False), ("warp", 1, False), ("warp", 0, True), ("warp", 1, True),
              ("lane", 0, False), ("lane", 8, False), ("lane", 4, False), ("lane", 0, True), ("lane", 4, True)]
    clock = "the device's part" if CLOCK[0] is device_chain_time else "chained"
    print(f"| the call (8B shape, one stream, bf16, {clock}) | us at 38 keys | us at 200 keys | us at 1,000 keys |")
    print("|---|---:|---:|---:|")
    rows: dict[str, list[str]] = {}
    agreed = []
    for at in (37, 199, 999):
        position = mx.array([at], dtype=mx.int32)
        empty = mx.array([at + 1], dtype=mx.int32)
        folded = (mx.array([at], dtype=mx.int32), inv, "half")
        err, written = cached_attention_load.agreement(q, k_new, v_new, k, v, live, at, scale, n=1, layout="warp",
                                                       rope=(rope, inv, "half"))
        agreed.append(f"{at + 1} keys: largest difference {err:.4f}, the cache {'as' if written else 'NOT as'} written")
        err, written = cached_attention_load.agreement(q, k_new, v_new, k, v, live, at, scale, n=1, layout="wide")
        agreed.append(f"wide at {at + 1} keys: {err:.4f}, the cache {'as' if written else 'NOT as'} written")
        err, written = cached_attention_load.agreement(q, k_new, v_new, k, v, live, at, scale, n=1, layout="wide",
                                                       rope=(rope, inv, "half"), rope_lanes=True)
        agreed.append(f"wide, each lane's rope, at {at + 1} keys: {err:.4f}, "
                      f"the cache {'as' if written else 'NOT as'} written")

        def cached(padding, layout, in_flight=0, dense=False, position=position, **kw):
            return lambda x: cached_attention_cuda.attend_cached(x, k_new, v_new, k, v, padding, position, scale, n=1,
                                                                 layout=layout, hsplit=1, in_flight=in_flight,
                                                                 dense=dense, **kw)

        forms = {f"whole, a key a {layout}, {n or 'its own'} in flight{', dense rows alone' if dense else ''}":
                 cached(live, layout, n, dense) for layout, n, dense in builds}
        forms["whole, a key a warp, no keys (start and end alone)"] = cached(empty, "warp")
        forms["whole, a key a lane, no keys"] = cached(empty, "lane")
        forms["whole, a key a warp, the rope folded in"] = cached(live, "warp", rope=folded)
        forms["whole, wide (a query head a block of 32 warps, a key a warp)"] = cached(live, "wide")
        forms["whole, wide, the rope folded in"] = cached(live, "wide", rope=folded)
        forms["whole, wide, dense, the rope folded in (the served form)"] = cached(live, "wide", 0, True, rope=folded)
        forms["whole, wide, dense, the rope in each lane's registers (GMLX_ROPE_LANES)"] = cached(
            live, "wide", 0, True, rope=folded, rope_lanes=True)
        forms["whole, wide, dense, no rope"] = cached(live, "wide", 0, True)
        # the launch shapes GMLX_ATTENTION_WIDE_SHAPES=1 has the load time, as served (dense rows, the rope folded in)
        for warps, in_flight in cached_attention_cuda.wide_shapes(d):
            forms[f"whole, wide, {warps} warps a block, {in_flight} key(s) in flight, dense, the rope folded in"] = (
                cached(live, "wide", in_flight, True, rope=folded, warps=warps))
            err, written = cached_attention_load.agreement(q, k_new, v_new, k, v, live, at, scale, n=1, layout="wide",
                                                           warps=warps, in_flight=in_flight)
            agreed.append(f"wide {warps}x{in_flight} at {at + 1} keys: {err:.4f}, "
                          f"the cache {'as' if written else 'NOT as'} written")
        forms["a kernel of the same launch reading the positions only"] = lambda x, position=position: floor(
            inputs=[x, live, position], grid=(kv_heads * attention_cuda.THREADS, 1, 1),
            threadgroup=(attention_cuda.THREADS, 1, 1), output_shapes=[(1, 1, heads * d)],
            output_dtypes=[mx.bfloat16])[0]
        forms["MLX's one-query attention"] = lambda x, at=at: mx.fast.scaled_dot_product_attention(
            x, k[..., :at + 1, :], v[..., :at + 1, :], scale=scale)
        for name, fn in forms.items():
            rows.setdefault(name, []).append(f"{per_product(fn, q, reps):.1f}")
    for name, cells in rows.items():
        print(f"| {name} | {' | '.join(cells)} |", flush=True)
    print("\nthe rope folded in against nn.RoPE and MLX's attention, and the wide form against MLX's: "
          + "; ".join(agreed))


def main() -> None:
    if {"-h", "--help"} & set(sys.argv):
        print(__doc__)
        return
    if "--ncu-csv" in sys.argv:  # reads a file: anywhere
        ncu_table(Path(sys.argv[sys.argv.index("--ncu-csv") + 1]), int(sys.argv[sys.argv.index("--reps") + 1]))
        return
    if not cuda_source.available():
        sys.exit("the kernel is built only on CUDA")
    print(f"device {mx.default_device()}")
    if "--device" in sys.argv:  # the device's part alone (each chain behind a lead product), not the chain's clock
        CLOCK[0] = device_chain_time
    if "--fixed" in sys.argv:
        check_fixed(int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 100)
        return
    if "--whole" in sys.argv:
        if not check_whole():
            print("the whole step DISAGREES")
        return
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 100
    if not check_cached(reps):
        print("the cached variant DISAGREES")
    if "--cached" in sys.argv:
        return
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
        kv = (k, v)
        t_k = per_product(lambda x, a=kv, s=scale, m=mask: attention_cuda.attend(x, *a, s, m), q, reps)
        t_m = per_product(lambda x, a=kv, s=scale, m=mask: mx.fast.scaled_dot_product_attention(x, *a, scale=s, mask=m),
                          q, reps)
        t_u = per_product(lambda x, a=kv, s=scale: mx.fast.scaled_dot_product_attention(x, *a, scale=s), q, reps)
        print(f"| {str(dtype).removeprefix('mlx.core.')} | {d} | {batch} | {keys} | {err_k:.4f} | {err_m:.4f} "
              f"| {t_k:.1f} | {t_m:.1f} | {t_u:.1f} |", flush=True)


if __name__ == "__main__":
    main()
