"""The padded batch's one-query attention kernel: its arithmetic (replayed in numpy)
against MLX's own masked attention on the CPU, which calls it takes, and its route
through mlx-lm's attention into a real model's decode step.

MLX has no CUDA backend on this machine, so the kernel cannot run through MLX here: its
own source runs on the CPU with CUDA's block primitives emulated (g++ and the CUDA
toolkit's headers; skipped without them), its arithmetic is replayed in numpy
(``attention_cuda.replay``: the same tiles, base-2 exponents and rescaling), and the
routing tests put that replay where the kernel would be, said in each.
``benchmarks/gpu/attention_check.py`` runs the kernel on the H200 against MLX."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from gmlx.engine import mlxlm
from gmlx.engine.kernels import (
    attention_cuda,
    cached_attention_cuda,
    cached_attention_load,
    cached_attention_source,
    cuda_source,
    rope_cuda,
)
from tests.engine.kernels import emulation, test_cuda_compile
from tests.engine.kernels.emulation import PRELUDE, compile_and_run


def _inputs(batch: int, heads: int, kv_heads: int, keys: int, d: int, padding: list[int], dtype=mx.float32):
    mx.random.seed(batch * 1000 + keys)
    q = mx.random.normal((batch, heads, 1, d)).astype(dtype)
    k = (mx.random.normal((batch, kv_heads, keys, d)) * 2).astype(dtype)  # wide scores: the max matters
    v = mx.random.normal((batch, kv_heads, keys, d)).astype(dtype)
    cols = mx.arange(keys)[None]
    mask = (mx.array(padding)[:, None, None, None] <= cols).reshape(batch, 1, 1, keys)
    return q, k, v, mask


@pytest.mark.parametrize("keys,padding", [(7, [0, 3, 6]), (300, [0, 17, 290]), (700, [0, 0, 520])])
def test_the_arithmetic_matches_mlx_masked_attention(keys: int, padding: list[int]) -> None:
    """One, two and three tiles of keys; a stream whose whole first tile is padding."""
    q, k, v, mask = _inputs(3, 8, 2, keys, 64, padding)
    scale = 64 ** -0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = attention_cuda.replay(np.array(q), np.array(k), np.array(v), scale, np.array(mask))
    assert np.allclose(got, np.array(want), rtol=1e-4, atol=1e-5)
    # a padded key changes nothing, whatever it holds
    k2 = mx.where(mask.transpose(0, 1, 3, 2), k, 1e4)
    again = attention_cuda.replay(np.array(q), np.array(k2), np.array(v), scale, np.array(mask))
    assert np.array_equal(got, again)


def test_which_calls_it_takes() -> None:
    q, k, v, mask = _inputs(2, 8, 2, 40, 128, [0, 5], mx.bfloat16)
    assert attention_cuda.supports(q, k, v, mask)
    assert attention_cuda.supports(q, k[..., :33, :], v[..., :33, :], mask[..., :33])  # the cache's views
    assert not attention_cuda.supports(q, k, v, None)  # unmasked: MLX's own one-query kernel
    assert not attention_cuda.supports(q, k, v, "causal")
    assert not attention_cuda.supports(q, k, v, mx.where(mask, 0.0, -1e9))  # an additive mask
    assert not attention_cuda.supports(q, k, v, mask, sinks=mx.zeros((8,)))
    assert not attention_cuda.supports(mx.concatenate([q, q], axis=2), k, v, mask)  # two queries
    assert not attention_cuda.supports(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), mask)
    assert not attention_cuda.supports(q[..., :96], k[..., :96], v[..., :96], mask)  # head size 96
    assert not attention_cuda.supports(q[:, :5], k, v, mask)  # 5 heads are not whole groups of 2
    assert not attention_cuda.supports(q, k, v, mask[:1])  # one mask row for two streams


def _replaying(calls: list[tuple]):
    """The kernel's place taken by its numpy replay (no CUDA here), recording its calls."""

    def attend(q, k, v, scale, mask):
        calls.append(q.shape)
        out = attention_cuda.replay(np.array(q.astype(mx.float32)), np.array(k.astype(mx.float32)),
                                    np.array(v.astype(mx.float32)), scale, np.array(mask))
        return mx.array(out).astype(q.dtype)

    return attend


def test_the_route_sends_only_what_it_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(attention_cuda, "attend", _replaying(calls))
    routed = attention_cuda.routed(mx.fast.scaled_dot_product_attention)
    assert routed.__wrapped__ is mx.fast.scaled_dot_product_attention
    q, k, v, mask = _inputs(2, 8, 2, 40, 64, [0, 5])
    q, k, v = (a.astype(mx.float16) for a in (q, k, v))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(routed(q, k, v, scale=0.125, mask=mask), want, atol=2e-3)
    assert calls == [(2, 8, 1, 64)]
    assert mx.array_equal(routed(q, k, v, scale=0.125, mask=None),
                          mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None))
    assert len(calls) == 1  # unmasked: MLX's


def test_a_routed_model_decodes_a_padded_batch_as_mlx_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's attention, routed (the kernel's replay in its place), gives a padded
    batch's decode step the logits MLX's own masked attention gives; the prompt's chunk
    stays MLX's; the route is made once. (A tiny llama in float16 with heads of 64: the
    demo model's heads of 32 in float32 are not the kernel's.)"""
    from mlx_lm.models import base
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(3)
    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    monkeypatch.setattr(base, "mx", base.mx)  # restored after the test
    prompts = [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 16, 17, 18]]
    padding = [0, 4]  # the second stream's prompt is its last three tokens

    def decode_logits():
        cache = [BatchKVCache(padding) for _ in model.layers]
        model(mx.array(prompts), cache=cache)
        return model(mx.array([[20], [21]]), cache=cache)[:, -1, :].astype(mx.float32)

    want = decode_logits()
    calls: list[tuple] = []
    monkeypatch.setattr(attention_cuda, "attend", _replaying(calls))
    mlxlm.route_attention(attention_cuda.routed)
    routed_fast = base.mx.fast
    mlxlm.route_attention(attention_cuda.routed)
    assert base.mx.fast is routed_fast  # once
    got = decode_logits()
    assert calls == [(2, 2, 1, 64)] * len(model.layers)  # each layer's one-query step, not the prompt
    assert mx.allclose(got, want, atol=2e-2).item()
    assert mx.fast.scaled_dot_product_attention is routed_fast.scaled_dot_product_attention.__wrapped__


def test_a_load_routes_only_on_cuda_unless_turned_off(demo_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is built only on CUDA, where it is on unless ``GMLX_ATTENTION_KERNEL=0``:
    on this CPU a load leaves mlx-lm's attention as MLX's, whatever the variable says."""
    from mlx_lm.models import base

    from gmlx.engine.kernels import prepare_layers

    monkeypatch.setattr(base, "mx", base.mx)
    monkeypatch.setenv("GMLX_ATTENTION_KERNEL", "1")
    assert not cuda_source.available() and not attention_cuda.enabled()
    prepare_layers(demo_model.model)
    assert base.mx is mx
    monkeypatch.setattr(cuda_source, "available", lambda: True)  # as on CUDA
    assert attention_cuda.enabled()
    monkeypatch.setenv("GMLX_ATTENTION_KERNEL", "0")
    assert not attention_cuda.enabled()
    monkeypatch.delenv("GMLX_ATTENTION_KERNEL")
    assert attention_cuda.enabled()  # on CUDA, on by default


# -- the kernel's own source, run on the CPU --------------------------------------------------

# The kernel's signature as MLX writes it, its body, and a main that runs its blocks.
def _emulated(factory, q, scale: float, input_types: list[str], args: str, splits: int,
              group: int | None = None, layout: str = "warp", hsplit: int = 1, rope: str = "",
              build: tuple[int, bool] = (0, False)) -> tuple[str, str]:
    """A kernel's source (``factory``: the routed or the cached one) as the host function
    ``kernel``, whole or split, and the C++ lines that run it over ``args``: whole, a
    block a (stream, head) writing ``out``; split, ``S`` blocks a head writing float32
    shares, then the combine kernel's source (``combine``) over them. With ``group`` (the
    cached kernel's query heads a key-value head), a block a (stream, key-value head), or
    ``hsplit`` blocks each, in ``layout``, its rope folded in where ``rope`` names the pairs,
    ``build`` its keys in flight and dense-only build."""
    d = q.shape[-1]
    dtype = str(q.dtype).removeprefix("mlx.core.")
    made = emulation.made(factory, q.dtype, d, scale, *([] if group is None else [group]), splits > 1,
                 *([] if group is None else [layout, hsplit, rope, *build]))
    blocks = "B * H" if group is None else f"B * HK * {hsplit}"
    source = emulation.function(made[0], input_types, dtype if splits == 1 else ["float32"] * 3)
    if splits == 1:
        return source, f"run_blocks({blocks}, THREADS_, [&] {{ kernel({args}, out.data()); }});"
    combine = emulation.made(attention_cuda._combine_kernel, q.dtype, d)
    source += emulation.function(combine[0], ["float32"] * 3, dtype).replace("void kernel(", "void combine(", 1)
    return source, (
        "std::vector<float> pacc((size_t)B * H * S * D), pm((size_t)B * H * S), pl((size_t)B * H * S);\n"
        "    Shape ps{B * H * S};\n"
        f"    run_blocks({blocks} * S, THREADS_, [&] {{ kernel({args}, pacc.data(), pm.data(), pl.data()); }});\n"
        "    run_blocks(B * H, D, [&] { combine(pacc.data(), pm.data(), ps, pl.data(), out.data()); });")


def _run_kernel_source(tmp: Path, q, k, v, mask, scale: float, capacity: int, splits: int = 1):
    """The kernel's source for ``q``'s dtype and head size, compiled with the emulation
    above and run over ``k`` and ``v`` held as the first positions of cache arrays of
    ``capacity`` positions (read through their strides, as the cache's views are; the
    positions past them hold 1e4, which would show in any output that read them); with
    ``splits``, the split form (each head's keys over that many blocks), then the
    combine kernel's source over the shares it wrote."""
    dtype = str(q.dtype).removeprefix("mlx.core.")
    source, run = _emulated(attention_cuda._kernel, q, scale, [dtype] * 3 + ["bool"],
                            "q.data(), qs, qt, k.data(), ks, kt, v.data(), kt, mb, mt", splits)
    main = r"""
int main(int argc, char** argv) {
    int a[8]; for (int i = 0; i < 8; ++i) a[i] = std::atoi(argv[i + 1]);
    const int B = a[0], H = a[1], HK = a[2], L = a[3], C = a[4], D = a[5], THREADS_ = a[6], S = a[7];
    using E = ELEMENT;
    auto q = load<E>("q.bin", (size_t)B * H * D);
    auto k = load<E>("k.bin", (size_t)B * HK * C * D);
    auto v = load<E>("v.bin", (size_t)B * HK * C * D);
    auto m = load<unsigned char>("mask.bin", (size_t)B * L);
    const bool* mb = reinterpret_cast<const bool*>(m.data());
    std::vector<E> out((size_t)B * H * D);
    Shape qs{B, H, 1, D}, ks{B, HK, L, D};
    Strides qt{(int64_t)H * D, D, D, 1}, kt{(int64_t)HK * C * D, (int64_t)C * D, D, 1}, mt{L, L, L, 1};
    SPLIT_RUN
    save("out.bin", out);
}
""".replace("ELEMENT", emulation.HOST_TYPES[dtype])
    beyond = [(0, 0), (0, 0), (0, capacity - k.shape[2]), (0, 0)]
    k_full, v_full = (mx.pad(a, beyond, constant_values=1e4) for a in (k, v))
    for name, a in (("q", q), ("k", k_full), ("v", v_full)):
        (tmp / f"{name}.bin").write_bytes(np.array(a.view(mx.uint16)).tobytes())
    (tmp / "mask.bin").write_bytes(np.array(mask.reshape(-1)).astype(np.bool_).tobytes())
    b, heads, _, d = q.shape
    compile_and_run(tmp, PRELUDE + source + main.replace("SPLIT_RUN", run),
                    [b, heads, k.shape[1], k.shape[2], capacity, d, attention_cuda.THREADS, splits])
    raw = np.frombuffer((tmp / "out.bin").read_bytes(), dtype=np.uint16).reshape(q.shape)
    return mx.array(raw).view(q.dtype)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,keys,padding,splits", [(mx.bfloat16, 128, 1300, [0, 17, 600], 3),
                                                         (mx.float16, 64, 700, [0, 300, 513], 4)])
def test_the_split_kernel_source_matches_mlx(tmp_path: Path, dtype, d: int, keys: int, padding: list[int],
                                             splits: int) -> None:
    """The routed kernel split over several blocks a head and combined: MLX's masked
    attention over the same views, streams padded past whole tiles."""
    q, k, v, mask = _inputs(3, 4, 2, keys, d, padding, dtype)
    scale = d ** -0.5
    got = _run_kernel_source(tmp_path, q, k, v, mask, scale, keys + 45, splits).astype(mx.float32)
    want = mx.fast.scaled_dot_product_attention(*(a.astype(mx.float32) for a in (q, k, v)), scale=scale, mask=mask)
    assert mx.allclose(got, want, atol=2e-2, rtol=2e-2).item(), mx.abs(got - want).max()


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,keys,padding", [(mx.bfloat16, 128, 300, [0, 17, 290]),
                                                  (mx.float16, 64, 40, [0, 3, 39]),
                                                  (mx.bfloat16, 256, 270, [0, 9, 261])])
def test_the_kernel_source_itself_matches_mlx(tmp_path: Path, dtype, d: int, keys: int, padding: list[int]) -> None:
    """The kernel's own source (not a replay), each block run as 256 host threads with
    CUDA's barriers and shuffles emulated, over views of longer cache arrays: two tiles
    of keys with a stream padded into its second, and one short tile; head size 256 (one
    group of threads for the values: the H200 check ran 64 and 128 only)."""
    q, k, v, mask = _inputs(3, 4, 2, keys, d, padding, dtype)
    scale = d ** -0.5
    got = _run_kernel_source(tmp_path, q, k, v, mask, scale, capacity=keys + 45).astype(mx.float32)
    want = mx.fast.scaled_dot_product_attention(*(a.astype(mx.float32) for a in (q, k, v)), scale=scale, mask=mask)
    assert mx.allclose(got, want, atol=2e-2, rtol=2e-2).item(), mx.abs(got - want).max()
    assert not mx.allclose(got, mx.fast.scaled_dot_product_attention(  # the padding was read
        *(a.astype(mx.float32) for a in (q, k, v)), scale=scale), atol=2e-2).item()


# -- the cached variant: the step's keys and values written into the cache in place ----------


def _cached_state(batch: int, heads: int, kv_heads: int, capacity: int, at: int, d: int, padding: list[int], dtype):
    """Queries, the step's new keys and values, cache arrays of ``capacity`` positions
    holding keys up to ``at`` (1e4 in each stream's padding and past ``at``: an output
    that read either would show it), and the padding."""
    mx.random.seed(capacity + at)
    q = mx.random.normal((batch, heads, 1, d)).astype(dtype)
    k_new, v_new = (mx.random.normal((batch, kv_heads, 1, d)) * s for s in (2, 1))
    k, v = (mx.random.normal((batch, kv_heads, capacity, d)) * s for s in (2, 1))
    cols = mx.arange(capacity)[None, None, :, None]
    pad = mx.array(padding, dtype=mx.int32)
    live = (cols >= pad[:, None, None, None]) & (cols < at)
    k, v = (mx.where(live, a, 1e4) for a in (k, v))
    return q, *(a.astype(dtype) for a in (k_new, v_new, k, v)), pad


def _cached_reference(q, k_new, v_new, k, v, pad, at: int, scale: float):
    """What mlx-lm's cache and MLX's attention make of the same step: the keys written,
    then the masked attention over the keys so far (float32)."""
    k, v = (mx.concatenate([a[..., :at, :], n, a[..., at + 1:, :]], axis=2) for a, n in ((k, k_new), (v, v_new)))
    mask = (mx.arange(at + 1)[None] >= pad[:, None]).reshape(q.shape[0], 1, 1, at + 1)
    out = mx.fast.scaled_dot_product_attention(*(a.astype(mx.float32) for a in (q, k[..., :at + 1, :], v[..., :at + 1, :])),
                                               scale=scale, mask=mask)
    return out, k, v


def _run_cached_source(tmp: Path, q, k_new, v_new, k, v, pad, at: int, scale: float, splits: int = 1,
                       layout: str = "warp", hsplit: int = 1, rope: tuple | None = None,
                       build: tuple[int, bool] = (0, False), cache_strides: str | None = None):
    """The cached kernel's own source in ``layout`` run here (emulated), ``hsplit`` blocks
    a key-value head; with ``splits``, the split form (each head's keys over that many
    blocks) and then the combine kernel's source over the shares it wrote; ``rope``
    (each stream's position, the inverse frequencies, the pairs) folds the rotation of
    ``q`` and ``k_new`` in; ``build`` (keys in flight, dense rows alone[, the wide form's
    warps a block[, each lane's rope]]) picks the kernel's build and ``cache_strides``
    replaces the strides the cache's arrays are handed with. Each store
    into the cache's keys is counted too, a count a (stream, key-value head): the fourth
    array returned."""
    dtype = str(q.dtype).removeprefix("mlx.core.")
    wide = layout == cached_attention_cuda.WIDE  # a query head a block, blocks of many warps
    hsplit = q.shape[1] // k.shape[1] if wide else hsplit
    warps = build[2] if len(build) > 2 else 0  # the wide form's warps a block, where given
    threads = (32 * warps or cached_attention_cuda.wide_threads(q.shape[-1])) if wide else attention_cuda.THREADS
    kernel, run = _emulated(cached_attention_cuda._kernel, q, scale,
                            [dtype] * 5 + ["int32", "int32"] + (["int32", "float32"] if rope else []),
                            "q.data(), qs, qt, kn.data(), nt, vn.data(), nt, k.data(), ks, kt, v.data(), kt, "
                            "pad.data(), pt, at.data()" + (", off.data(), pt, inv.data()" if rope else ""), splits,
                            q.shape[1] // k.shape[1], layout, hsplit, rope[2] if rope else "", build)
    store = "kb[(int64_t)at * k_strides[2]"  # the key's store (as the value's, by the same threads)
    assert kernel.count(store) == 1
    kernel = "static std::atomic<int> stores[1024];\n" + kernel.replace(
        store, "stores[b * kv_heads + kvh].fetch_add(1), " + store)
    main = r"""
int main(int argc, char** argv) {
    int a[8]; for (int i = 0; i < 8; ++i) a[i] = std::atoi(argv[i + 1]);
    const int B = a[0], H = a[1], HK = a[2], C = a[3], D = a[4], THREADS_ = a[5], AT = a[6], S = a[7];
    using E = ELEMENT;
    auto q = load<E>("q.bin", (size_t)B * H * D);
    auto kn = load<E>("kn.bin", (size_t)B * HK * D);
    auto vn = load<E>("vn.bin", (size_t)B * HK * D);
    auto k = load<E>("k.bin", (size_t)B * HK * C * D);
    auto v = load<E>("v.bin", (size_t)B * HK * C * D);
    auto pad = load<int32_t>("pad.bin", (size_t)B);
    auto off = ROPE ? load<int32_t>("off.bin", (size_t)B) : std::vector<int32_t>(B);
    auto inv = ROPE ? load<float>("inv.bin", (size_t)D / 2) : std::vector<float>(D / 2);
    std::vector<int32_t> at{AT};
    std::vector<E> out((size_t)B * H * D);
    Shape qs{B, H, 1, D}, ks{B, HK, C, D};
    Strides qt{(int64_t)H * D, D, D, 1}, nt{(int64_t)HK * D, D, D, 1}, kt{(int64_t)HK * C * D, (int64_t)C * D, D, 1}, pt{1};
    SPLIT_RUN
    save("out.bin", out); save("k.bin", k); save("v.bin", v);
    std::vector<int32_t> counted(B * HK);
    for (int i = 0; i < B * HK; ++i) counted[i] = stores[i].load();
    save("stores.bin", counted);
}
""".replace("ELEMENT", emulation.HOST_TYPES[dtype])
    main = main.replace("SPLIT_RUN", run).replace("ROPE ?", f"{'true' if rope else 'false'} ?")
    if cache_strides is not None:
        main = main.replace("kt{(int64_t)HK * C * D, (int64_t)C * D, D, 1}", f"kt{{{cache_strides}}}")
    if rope:
        (tmp / "off.bin").write_bytes(np.array(rope[0]).astype(np.int32).tobytes())
        (tmp / "inv.bin").write_bytes(np.array(rope[1]).astype(np.float32).tobytes())
    for name, a in (("q", q), ("kn", k_new), ("vn", v_new), ("k", k), ("v", v)):
        (tmp / f"{name}.bin").write_bytes(np.array(a.view(mx.uint16)).tobytes())
    (tmp / "pad.bin").write_bytes(np.array(pad).astype(np.int32).tobytes())
    b, heads, _, d = q.shape
    compile_and_run(tmp, "#include <atomic>\n" + PRELUDE + kernel + main,
                    [b, heads, k.shape[1], k.shape[2], d, threads, at, splits])

    def read(name: str, shape: tuple) -> mx.array:
        raw = np.frombuffer((tmp / name).read_bytes(), dtype=np.uint16).reshape(shape)
        return mx.array(raw).view(q.dtype)

    stores = np.frombuffer((tmp / "stores.bin").read_bytes(), dtype=np.int32).reshape(b, k.shape[1])
    return read("out.bin", (b, 1, heads * d)), read("k.bin", k.shape), read("v.bin", v.shape), stores


def _cached_matches_mlx(tmp: Path, state: tuple, splits: int = 1, layout: str = "warp",
                        hsplit: int = 1, rope: tuple | None = None,
                        build: tuple[int, bool] = (0, False)) -> tuple[mx.array, mx.array]:
    """The cached kernel's source run (emulated) over ``_cached_state(*state)``: its output
    is MLX's attention over the keys so far with the step's at ``at``, and the cache's
    arrays after it are the old ones with that position replaced, nothing else touched,
    each dimension of each (stream, key-value head) stored once (by one block of the
    ``splits`` x ``hsplit`` sharing it). With ``rope`` (a rope module of mlx's and each
    stream's position), the kernel is handed the queries and key unrotated and rotates
    them itself: the reference rotates them with the module first. Returns the keys
    before and after."""
    q, k_new, v_new, k, v, pad = _cached_state(*state)
    at, d = state[4], state[5]
    scale = d ** -0.5
    folded = None
    if rope is not None:
        module, offset = rope
        inv, traditional = rope_cuda.inverse_frequencies(module, d)
        folded = (offset, inv, "pairs" if traditional else "half")
    got, k_after, v_after, stores = _run_cached_source(tmp, q, k_new, v_new, k, v, pad, at, scale, splits, layout,
                                                       hsplit, folded, build)
    k_raw = k_new
    if rope is not None:
        q, k_new = module(q, offset=offset), module(k_new, offset=offset)
    want, k_want, v_want = _cached_reference(q, k_new, v_new, k, v, pad, at, scale)
    want = want.reshape(got.shape)
    assert mx.allclose(got.astype(mx.float32), want, atol=2e-2, rtol=2e-2).item(), mx.abs(got - want).max()
    if rope is not None:  # the key rotated here as there, but for the angles' last bits (inv computed apart)
        new, new_want = k_after[:, :, at].astype(mx.float32), k_want[:, :, at].astype(mx.float32)
        assert mx.allclose(new, new_want, atol=2e-2, rtol=2e-2).item(), mx.abs(new - new_want).max()
        assert not mx.allclose(new, k_raw[:, :, 0].astype(mx.float32), atol=0.1).item()  # rotated, not the projection's
        k_after, k_want = (mx.concatenate([a[:, :, :at], a[:, :, at + 1:]], axis=2) for a in (k_after, k_want))
    assert mx.array_equal(k_after, k_want).item() and mx.array_equal(v_after, v_want).item()
    assert (stores == d).all(), stores
    return k, k_after


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,capacity,at,padding", [(mx.bfloat16, 128, 512, 300, [0, 17, 290]),
                                                         (mx.float16, 64, 256, 40, [0, 3, 40]),
                                                         (mx.bfloat16, 64, 512, 256, [0, 0, 255]),
                                                         (mx.float16, 256, 512, 270, [0, 9, 261])])
@pytest.mark.parametrize("layout", cached_attention_cuda.LAYOUTS)
def test_the_cached_kernel_writes_the_step_in_place_and_attends_as_mlx_does(
        tmp_path: Path, dtype, d: int, capacity: int, at: int, padding: list[int], layout: str) -> None:
    """The cached kernel's own source, emulated: its output is MLX's masked attention
    over the keys so far with the step's written at ``at`` (a stream whose only key is
    the new one; the new key at a tile's first position), shaped for the output
    projection; the cache arrays after it are the old ones with position ``at`` replaced
    and nothing else touched; neither the padding nor what lies past ``at`` was read."""
    k, k_after = _cached_matches_mlx(tmp_path, (3, 4, 2, capacity, at, d, padding, dtype), 1, layout)
    assert not mx.array_equal(k_after, k).item()  # it wrote


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,capacity,at,padding", [(mx.bfloat16, 128, 512, 300, [0, 17, 290]),
                                                         (mx.float16, 64, 64, 20, [0, 3, 20]),
                                                         (mx.float16, 256, 512, 270, [0, 9, 261])])
def test_the_wide_form_writes_the_step_in_place_and_attends_as_mlx_does(
        tmp_path: Path, dtype, d: int, capacity: int, at: int, padding: list[int]) -> None:
    """The wide form (a query head a block of 32 warps, 16 for heads of 256; a key a warp):
    MLX's attention and the cache written once a (stream, key-value head), where a
    stream's keys number fewer than the warps (most warps hold none, and a stream
    whose only key is the step's) and where each warp takes several."""
    k, k_after = _cached_matches_mlx(tmp_path, (3, 4, 2, capacity, at, d, padding, dtype), 1,
                                     cached_attention_cuda.WIDE)
    assert not mx.array_equal(k_after, k).item()
    rope = nn.RoPE(d, base=10000.0)  # and with the rope folded in
    _cached_matches_mlx(tmp_path, (3, 4, 2, capacity, at, d, padding, dtype), 1, cached_attention_cuda.WIDE,
                        rope=(rope, mx.array([at - p for p in padding], dtype=mx.int32)))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("layout,traditional", [(cached_attention_cuda.WIDE, False), ("warp", False),
                                                (cached_attention_cuda.WIDE, True)])
@pytest.mark.parametrize("dtype,d,capacity,at,padding", [(mx.bfloat16, 128, 512, 300, [0, 17, 290]),
                                                         (mx.float16, 64, 64, 20, [0, 3, 20])])
def test_each_lane_rotating_its_own_dimensions_attends_as_mlx_does(
        tmp_path: Path, dtype, d: int, capacity: int, at: int, padding: list[int], layout: str,
        traditional: bool) -> None:
    """With ``GMLX_ROPE_LANES`` a key-a-warp form (wide or not) takes the rope in each
    lane's registers, not through shared memory: MLX's attention over the queries and
    key rotated by the layer's rope (half pairs and traditional ones), the key written
    rotated, the cache written once a (stream, key-value head); and the key it writes is
    the shared-memory rotation's, bit for bit (the same arithmetic)."""
    rope = (nn.RoPE(d, traditional=traditional, base=10000.0), mx.array([at - p for p in padding], dtype=mx.int32))
    state = (3, 4, 2, capacity, at, d, padding, dtype)
    _, lanes = _cached_matches_mlx(tmp_path, state, 1, layout, rope=rope, build=(0, True, 0, True))
    _, shared = _cached_matches_mlx(tmp_path, state, 1, layout, rope=rope, build=(0, True))
    assert mx.array_equal(lanes, shared).item()  # the key written, bit for bit


def test_the_lanes_rope_is_asked_for_and_a_key_a_warps_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attend_cached`` builds the lanes' rope only with ``GMLX_ROPE_LANES=1``, only with
    the rope folded in, and never for a key a lane (whose queries are shared anyway)."""
    made: list[dict] = []
    monkeypatch.setattr(cached_attention_cuda, "_kernel", lambda *a, **kw: made.append((a[5], a[7], kw)) or a)
    monkeypatch.setattr(attention_cuda, "in_blocks", lambda kernel, *rest, **kw: kernel(False))
    k = mx.zeros((1, 2, 64, 64), mx.float16)
    rope = (mx.zeros((1,), mx.int32), mx.ones((32,), mx.float32), "half")

    def call(layout, with_rope=True):
        cached_attention_cuda.attend_cached(mx.zeros((1, 4, 1, 64), mx.float16), k[..., :1, :], k[..., :1, :], k, k,
                                            mx.zeros((1,), mx.int32), mx.array([7], mx.int32), 0.125, n=1,
                                            layout=layout, rope=rope if with_rope else None)

    call("wide")
    monkeypatch.setenv(cached_attention_cuda.ROPE_LANES_ENV, "1")
    for layout in ("wide", "warp", "lane"):
        call(layout)
    call("warp", with_rope=False)
    assert [kw.get("rope_lanes", False) for *_, kw in made] == [False, True, True, False, False]
    with pytest.raises(ValueError, match="a key is a warp's"):
        cached_attention_source.body("lane", rope=True, lanes=True)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,capacity,at,padding", [(mx.bfloat16, 128, 512, 300, [0, 17, 290]),
                                                         (mx.float16, 256, 512, 270, [0, 9, 261])])
def test_the_wide_forms_other_launch_shapes_attend_as_mlx_does(
        tmp_path: Path, dtype, d: int, capacity: int, at: int, padding: list[int]) -> None:
    """Each launch shape the load may time for the wide form beside its own
    (:func:`cached_attention_cuda.wide_shapes`: fewer warps a block, more keys in flight
    a warp, a stream's keys ending inside a warp's keys in flight), dense rows as
    gmlx's caches hold them, with the rope folded in: MLX's attention, the cache written
    once a (stream, key-value head)."""
    rope = nn.RoPE(d, base=10000.0)
    offsets = mx.array([at - p for p in padding], dtype=mx.int32)
    for warps, in_flight in cached_attention_cuda.wide_shapes(d)[1:]:
        k, k_after = _cached_matches_mlx(tmp_path, (3, 4, 2, capacity, at, d, padding, dtype), 1,
                                         cached_attention_cuda.WIDE, rope=(rope, offsets),
                                         build=(in_flight, True, warps))
        assert not mx.array_equal(k_after, k).item()


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,capacity,at,padding,splits", [(mx.bfloat16, 128, 1536, 1300, [0, 17, 600], 3),
                                                                (mx.float16, 64, 1024, 700, [0, 300, 513], 4),
                                                                (mx.bfloat16, 64, 1024, 100, [0, 5, 90], 2)])
@pytest.mark.parametrize("layout", cached_attention_cuda.LAYOUTS)
def test_the_split_cached_kernel_and_its_combine_attend_as_mlx_does(tmp_path: Path, dtype, d: int, capacity: int,
                                                                     at: int, padding: list[int], splits: int, layout: str) -> None:
    """A long cache's keys shared evenly between several blocks a key-value head, their
    shares combined by the second kernel: the same attention as mlx-lm's cache and
    MLX's, the step's position written in place once; streams padded far (splits of
    few keys each)."""
    _cached_matches_mlx(tmp_path, (3, 4, 2, capacity, at, d, padding, dtype), splits, layout)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,heads,kv_heads,d,at,splits", [(mx.float16, 8, 2, 128, 5, 8),
                                                              (mx.bfloat16, 8, 1, 128, 600, 5),
                                                              (mx.float16, 6, 2, 256, 77, 3)])
@pytest.mark.parametrize("layout", cached_attention_cuda.LAYOUTS)
def test_the_cached_kernel_serves_a_whole_group_of_query_heads(tmp_path: Path, dtype, heads: int, kv_heads: int,
                                                               d: int, at: int, splits: int, layout: str) -> None:
    """One stream, as a decode step of one conversation runs it: each block reads its
    key-value head's keys once for the whole group of query heads (4, 8 and 3 of
    them), more splits than keys (six keys over eight blocks: two of them empty), the
    largest head size; MLX's attention over the same keys."""
    _cached_matches_mlx(tmp_path, (1, heads, kv_heads, 768, at, d, [0], dtype), splits, layout)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,heads,hsplit", [(mx.bfloat16, 128, 8, 4), (mx.float16, 64, 8, 2),
                                                  (mx.bfloat16, 64, 6, 3)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", cached_attention_cuda.LAYOUTS)
def test_a_head_split_shares_each_group_between_blocks_and_attends_as_mlx_does(
        tmp_path: Path, dtype, d: int, heads: int, hsplit: int, splits: int, layout: str) -> None:
    """The head split: each key-value head's query heads (4, and 3) shared between
    ``hsplit`` blocks (one query head a block where it is the whole group), whole and
    split, a second stream padded far: MLX's attention, the step's key and value stored
    into the cache once (by the first part's first split), nothing else touched."""
    _cached_matches_mlx(tmp_path, (2, heads, 2, 512, 300, d, [0, 130], dtype), splits, layout, hsplit)


def _assembled(tmp_path: Path, kernels: list[tuple], *flags: str) -> str:
    """``kernels`` (what ``mx.fast.cuda_kernel`` was handed, with their input and output
    types) wrapped as MLX wraps them (``test_cuda_compile``) and assembled for sm_90, as
    the driver assembles MLX's PTX at a launch (ptxas refuses a block's static shared
    memory past 48 KB, which PTX alone does not): ptxas's messages."""
    names = [kernel[0]["name"] for kernel in kernels]
    assert len(set(names)) == len(names)
    source = test_cuda_compile._HEADER + "\n".join(test_cuda_compile._wrapped(*k) for k in kernels) + "} // namespace\n"
    (tmp_path / "kernels.cu").write_text(source)
    done = subprocess.run([test_cuda_compile.NVCC, "-arch=sm_90", "-std=c++17", "-cubin", *flags, "-o", "kernels.cubin",
                           "kernels.cu"], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def _cached_kernels(monkeypatch: pytest.MonkeyPatch, builds: list[tuple]) -> list[tuple]:
    """The in-place kernel made for each of ``builds`` (``_kernel``'s arguments), with its
    input and output types."""
    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    factory = cached_attention_cuda._kernel
    factory.cache_clear()
    kernels = []
    try:
        for dtype, d, group, split, layout, hsplit, rope, *lanes in builds:  # (each lane's own rope)
            factory(dtype, d, d ** -0.5, group, split, layout, hsplit, rope, 0, True, 0, *lanes)
            kernels.append((made[-1], [dtype, *[dtype] * 4, mx.int32, mx.int32, *([mx.int32, mx.float32] if rope else [])],
                            [mx.float32] * 3 if split else None))
    finally:
        factory.cache_clear()
    return kernels


@pytest.mark.skipif(test_cuda_compile.NVCC is None, reason="no nvcc here (the CUDA toolkit) to compile the kernels with")
def test_the_head_split_kernels_compile_for_sm90(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The head split's kernels (a group of 4 in 2 and 4 blocks, and the largest group
    each layout is built for in as many blocks: one query head a block), whole and split,
    both layouts, each head size and float type, compiled and assembled for sm_90 as MLX
    compiles them (``test_cuda_compile`` builds one block a key-value head)."""
    builds = []
    for dtype in (mx.float16, mx.bfloat16):
        for d in attention_cuda.HEAD_DIMS:
            for layout in cached_attention_cuda.LAYOUTS:
                largest = max(g for g in range(1, 64) if cached_attention_cuda.fits(g, d, layout))
                for group, hsplit in dict.fromkeys(((4, 2), (4, 4), (largest, largest))):
                    builds += [(dtype, d, group, split, layout, hsplit, "") for split in (False, True)]
    _assembled(tmp_path, _cached_kernels(monkeypatch, builds))


@pytest.mark.skipif(test_cuda_compile.NVCC is None, reason="no nvcc here (the CUDA toolkit) to compile the kernels with")
def test_the_wide_forms_registers_fit_its_blocks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The wide form's blocks are large (1,024 threads for heads of up to 128, 512 for
    heads of 256): a launch fails where a thread's registers times the block's threads
    pass the SM's 65,536. Each head size and float type, with the rope folded in or not
    (through shared memory or each lane's own), assembled for sm_90 as MLX compiles it, within that (ptxas's count; the driver
    assembles MLX's PTX with the same allocator)."""
    kernels = _cached_kernels(monkeypatch, [(dtype, d, 4, False, "wide", 4, rope, lanes)
                                            for dtype in (mx.float16, mx.bfloat16) for d in attention_cuda.HEAD_DIMS
                                            for rope, lanes in (("", False), ("half", False), ("half", True))])
    used: dict[str, int] = {}
    entry = None
    for line in _assembled(tmp_path, kernels, "-Xptxas", "-v").splitlines():
        if found := re.search(r"Compiling entry function '(\S+)'", line):
            entry = found[1]
        elif (found := re.search(r"Used (\d+) registers", line)) and entry:
            used[entry] = int(found[1])
    assert len(used) == len(kernels)
    for kernel, *_ in kernels:
        (registers,) = [n for name, n in used.items() if kernel["name"] in name]
        d = int(re.search(r"_(64|128|256)_g", kernel["name"])[1])
        assert registers * cached_attention_cuda.wide_threads(d) <= 65536, (kernel["name"], registers)


def test_long_caches_split_toward_the_target_and_short_ones_do_not() -> None:
    assert attention_cuda.splits(32, 512) == 1  # one stream of an 8B, a short cache: one launch
    assert attention_cuda.splits(32, 1024) == 2
    assert attention_cuda.splits(32, 32768) == 32  # 1,024 blocks
    assert attention_cuda.splits(8 * 32, 32768) == 4
    assert attention_cuda.splits(32 * 32, 32768) == 1  # enough blocks already
    assert attention_cuda.splits(1, 300) == 1


def test_a_load_compiles_both_forms_of_the_in_place_kernel_for_each_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_cached`` runs the in-place kernel once whole and once split for each
    distinct attention shape that writes in place, so a later long cache's first step
    compiles nothing, and holds each call to MLX's attention over the keys with the
    step's written (the kernel's place taken here by its arithmetic in numpy: no CUDA);
    a kernel that answers wrong, or does not write the cache, fails the load's check."""
    from mlx_lm.models.llama import Model, ModelArgs

    from gmlx.engine.kernels import one_token

    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    calls: list[tuple] = []
    replaying = _cached_replaying([])

    def recorded(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        calls.append((q.shape, k.shape, q.dtype, scale, n, hsplit, layout))
        return replaying(q, k_new, v_new, k, v, padding, position, scale)

    monkeypatch.setattr(cached_attention_cuda, "_lane_agrees", {})
    monkeypatch.setattr(cached_attention_cuda, "_wide_agrees", {})
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", recorded)
    assert cached_attention_load.compile_cached(model) == 0  # nothing writes in place
    one_token.attach(model, in_place=True, fold=False)  # (the rope folded in: its own test)
    assert cached_attention_load.compile_cached(model) == 1  # two layers, one shape
    # whole, split, then whole a query head a block (the group of two split), a key a warp, then a key a lane;
    # then the wide form whole over a short cache and a longer one
    assert [(k[2], n, hsplit, layout) for _, k, *_, n, hsplit, layout in calls] == [
        (32, 1, 1, "warp"), (512, 16, 1, "warp"), (32, 1, 2, "warp"),
        (32, 1, 1, "lane"), (512, 16, 1, "lane"), (32, 1, 2, "lane"), (32, 1, 1, "wide"), (512, 1, 1, "wide")]
    assert all(q == (2, 2, 1, 64) and dtype == mx.float16 and scale == 64 ** -0.5 for q, _, dtype, scale, *_ in calls)
    assert cached_attention_cuda._lane_agrees[(2, 1, 64, str(mx.float16))]
    assert cached_attention_cuda._wide_agrees[(2, 1, 64, str(mx.float16))]
    calls.clear()
    monkeypatch.setenv("GMLX_ATTENTION_WIDE", "0")  # a comparison without it: never checked, so never timed or taken
    assert cached_attention_load.compile_cached(model) == 1
    assert "wide" not in {layout for *_, layout in calls} and len(calls) == 6
    assert not cached_attention_cuda._wide_agrees[(2, 1, 64, str(mx.float16))]
    monkeypatch.delenv("GMLX_ATTENTION_WIDE")

    def wrong(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        return replaying(q, k_new, v_new, k, v, padding, position, scale) + 0.25

    def lane_wrong(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        return replaying(q, k_new, v_new, k, v, padding, position, scale) + (0.25 if layout == "lane" else 0)

    def head_split_wrong(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        return replaying(q, k_new, v_new, k, v, padding, position, scale) + (0.25 if hsplit > 1 else 0)

    # a key-a-lane kernel that disagrees is only never used; the load goes on
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", lane_wrong)
    assert cached_attention_load.compile_cached(model) == 1
    assert not cached_attention_cuda._lane_agrees[(2, 1, 64, str(mx.float16))]
    assert cached_attention_cuda._wide_agrees[(2, 1, 64, str(mx.float16))]

    def wide_wrong(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        return replaying(q, k_new, v_new, k, v, padding, position, scale) + (0.25 if layout == "wide" else 0)

    # likewise a wide kernel
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", wide_wrong)
    assert cached_attention_load.compile_cached(model) == 1
    assert cached_attention_cuda._lane_agrees[(2, 1, 64, str(mx.float16))]
    assert not cached_attention_cuda._wide_agrees[(2, 1, 64, str(mx.float16))]

    def unwritten(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        k_old, v_old = np.array(k), np.array(v)
        out = replaying(q, k_new, v_new, k, v, padding, position, scale)
        np.array(k, copy=False)[...], np.array(v, copy=False)[...] = k_old, v_old  # the write undone
        return out

    for bad, says in ((wrong, "largest difference 0.25"), (unwritten, "the cache not written"),
                      (head_split_wrong, "a key a warp, 2 block")):  # the head split too fails the load
        monkeypatch.setattr(cached_attention_cuda, "attend_cached", bad)
        with pytest.raises(RuntimeError, match=says):
            cached_attention_load.compile_cached(model)
    one_token.detach(model)


def test_a_kernel_that_does_not_compile_leaves_the_layers_to_the_cache(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The load compiles the in-place kernel before ready; where NVRTC or MLX refuses it
    (stood in for here: no CUDA), the load goes on with one warning, every layer's
    one-token step attends through mlx-lm's cache, and no whole step is traced over
    them."""
    import logging

    from mlx_lm.models.llama import Model, ModelArgs

    from gmlx.engine import kernels
    from gmlx.engine.kernels import one_token

    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    one_token.attach(model, in_place=True)

    def refused(model):
        raise RuntimeError("Failed to compile kernel: gmlx_attend_cached_half_64_g2.\nerror: ...")

    monkeypatch.setattr(cached_attention_load, "compile_cached", refused)
    with caplog.at_level(logging.WARNING, logger="gmlx.engine.kernels"):
        assert not kernels.compile_in_place(model)
    assert "the in-place attention is not used: Failed to compile kernel" in caplog.text
    layers = [m for _, m in model.named_modules() if hasattr(m, "_in_place")]
    assert len(layers) == 2 and not any(m._in_place for m in layers)
    monkeypatch.setattr(cached_attention_load, "compile_cached", lambda model: 1)
    tuned: list = []
    monkeypatch.setattr(cached_attention_load, "tune_splits", lambda model: tuned.append(model) or ["2 heads over 1"])
    one_token.detach(model)
    one_token.attach(model, in_place=True)
    assert kernels.compile_in_place(model)  # compiled: the whole step may follow
    assert tuned == [model]  # and where its split pays, timed

    def failed(model):
        raise RuntimeError("an illegal memory access\n...")

    monkeypatch.setattr(cached_attention_load, "tune_splits", failed)
    with caplog.at_level(logging.WARNING, logger="gmlx.engine.kernels"):
        assert kernels.compile_in_place(model)  # the default threshold, the load goes on
    assert "splits as by default: an illegal memory access" in caplog.text
    one_token.detach(model)


def test_the_launches_whole_and_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """What MLX is asked to launch (``mx.fast.cuda_kernel`` recorded: no CUDA here): a
    short cache, one kernel a block a head writing the output; a long one, the split
    kernel's blocks writing float32 shares, then the combine over them, a thread a
    dimension; both for the routed kernel and the cached one (built for dense rows alone,
    its default), the cached one also with its key-value head's query heads split
    between two blocks."""
    launched: list[tuple] = []

    def cuda_kernel(**made):
        def launch(*, inputs, grid, threadgroup, output_shapes, output_dtypes):
            launched.append((made["name"].rsplit("_", 1)[0], grid[0] // threadgroup[0], threadgroup[0],
                             [tuple(o) for o in output_shapes], output_dtypes))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    factories = (attention_cuda._kernel, cached_attention_cuda._kernel, attention_cuda._combine_kernel)
    for factory in factories:
        factory.cache_clear()  # made afresh through the stand-in, forgotten after
    try:
        q = mx.zeros((1, 2, 1, 64), mx.float16)
        for keys in (512, 1024):
            k = mx.zeros((1, 1, keys, 64), mx.float16)
            mask = mx.ones((1, 1, 1, keys), mx.bool_)
            assert attention_cuda.attend(q, k, k, 0.125, mask).shape == (1, 2, 1, 64)
        for hsplit in (None, 2):
            for capacity in (32, 1024):
                k = mx.zeros((1, 1, capacity, 64), mx.float16)
                assert cached_attention_cuda.attend_cached(q, k[..., :1, :], k[..., :1, :], k, k,
                                                           mx.zeros((1,), mx.int32), mx.array([7], mx.int32), 0.125,
                                                           hsplit=hsplit).shape == (1, 1, 128)
        k = mx.zeros((1, 1, 32, 64), mx.float16)
        assert cached_attention_cuda.attend_cached(q, k[..., :1, :], k[..., :1, :], k, k, mx.zeros((1,), mx.int32),
                                                   mx.array([7], mx.int32), 0.125, layout="wide").shape == (1, 1, 128)
    finally:
        for factory in factories:
            factory.cache_clear()
    whole = [(1, 1, 128)], [mx.float16]
    assert launched == [
        ("gmlx_attend_half_64", 2, 256, [(1, 2, 1, 64)], [mx.float16]),
        ("gmlx_attend_half_64_split", 4, 256, [(4, 64), (4,), (4,)], [mx.float32] * 3),  # two blocks a head
        ("gmlx_attend_combine_half_64", 2, 64, [(1, 2, 1, 64)], [mx.float16]),
        ("gmlx_attend_cached_half_64_g2_dense", 1, 256, *whole),  # a block the key-value head: its two query heads
        ("gmlx_attend_cached_half_64_g2_split_dense", 32, 256, [(64, 64), (64,), (64,)], [mx.float32] * 3),
        ("gmlx_attend_combine_half_64", 2, 64, *whole),  # a block a query head
        ("gmlx_attend_cached_half_64_g2_h2_dense", 2, 256, *whole),  # the head split: a block a query head
        ("gmlx_attend_cached_half_64_g2_h2_split_dense", 64, 256, [(64, 64), (64,), (64,)], [mx.float32] * 3),
        ("gmlx_attend_combine_half_64", 2, 64, *whole),  # the same shares: (stream, query head, split)
        ("gmlx_attend_cached_half_64_g2_h2_wide_dense", 2, 1024, *whole),  # wide: a query head a block of 32 warps
    ]


def test_the_cached_kernel_splits_toward_its_target() -> None:
    """A block a (stream, key-value head) whole until the capacity reaches ``split_keys``
    positions (by default ``SPLIT_KEYS``), then split toward ``TARGET_BLOCKS``, a split
    for every 32 positions of the capacity at most; never where the batch's blocks
    already fill a wave of the GPU's SMs (half the target), unless forced
    (``split_keys=0``: the load's check and timing)."""
    splits = cached_attention_cuda.splits
    assert cached_attention_cuda.SPLIT_KEYS == 1024
    assert splits(8, 32) == 1  # one stream of an 8B, a tiny cache
    assert splits(8, 512) == 1  # short: the whole form won on the H200
    assert splits(8, 1024) == 32  # a split for every 32 positions
    assert splits(8, 2304) == 33  # 264 blocks
    assert splits(8, 32768) == 33
    assert splits(64, 512) == 1
    assert splits(64, 8192) == 5  # 8 streams: the split won at 8,000 keys (195 against 328 us)
    assert splits(256, 8192) == 1  # 32 streams fill a wave: the whole form won at 2,100 keys
    assert splits(8, 256, split_keys=0) == 8  # as the load's check forces it
    assert splits(32 * 8, 8192, split_keys=0) == 2
    assert splits(64 * 8, 8192, split_keys=0) == 1  # enough blocks already
    assert splits(8, 512, split_keys=256) == 16  # a load that measured the split paying sooner


def _tuned_model(heads: int = 4):
    from mlx_lm.models.llama import Model, ModelArgs

    from gmlx.engine.kernels import one_token

    model = Model(ModelArgs(model_type="llama", hidden_size=64 * heads, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=heads, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    one_token.attach(model, in_place=True)
    return model


def _no_choices(monkeypatch: pytest.MonkeyPatch, lane_agrees: dict | None = None,
                wide_agrees: dict | None = None) -> None:
    """No load's choices for the in-place attention yet (split thresholds, layouts, head
    splits, the wide form), and which shapes' lane and wide forms agreed at the check."""
    for name in ("_split_keys", "_layouts", "_hsplits", "_wide"):
        monkeypatch.setattr(cached_attention_cuda, name, {})
    monkeypatch.setattr(cached_attention_cuda, "_lane_agrees", lane_agrees or {})
    monkeypatch.setattr(cached_attention_cuda, "_wide_agrees", wide_agrees or {})


def _launches(monkeypatch: pytest.MonkeyPatch) -> tuple[list, Any]:
    """What ``attend_cached`` launches (splits, whole or split, layout, blocks a key-value
    head, blocks before the splits), nothing run, and a call of it over a cache of
    ``capacity`` positions (``batch`` streams of ``heads`` query heads over ``kv``)."""
    launched: list = []
    monkeypatch.setattr(cached_attention_cuda, "_kernel",
                        lambda dtype, d, scale, group, split, layout, hsplit, rope="", in_flight=0, dense=False: (split, layout, hsplit))
    monkeypatch.setattr(attention_cuda, "in_blocks",
                        lambda kernel, inputs, q, n, blocks, out_shape, threads=attention_cuda.THREADS:
                        launched.append((n, *kernel(n > 1), blocks)))

    def attend(capacity: int, kv: int = 2, heads: int = 4, batch: int = 1, hsplit: int | None = None) -> None:
        k = mx.zeros((batch, kv, capacity, 64), mx.float16)
        cached_attention_cuda.attend_cached(mx.zeros((batch, heads, 1, 64), mx.float16), k[..., :1, :], k[..., :1, :],
                                            k, k, mx.zeros((batch,), mx.int32), mx.array([7], mx.int32), 0.125,
                                            hsplit=hsplit)
    return launched, attend


def test_the_load_times_where_a_split_starts_to_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tune_splits`` times one stream's call whole and split at each capacity it tries
    (the clock a stand-in here: no GPU) and takes the smallest capacity from which the
    split won at every one after it, for each in-place shape; ``attend_cached`` then
    splits that shape from there and other shapes by the default. A split that never wins
    keeps the whole form up to twice the longest timed; the timing is in the log line.
    Where the key-a-lane form did not agree at the load's check, only the key-a-warp
    form is timed and used; with ``GMLX_HEAD_SPLIT=1`` the head split (a group of two: one
    block a key-value head or two) first, and a tie keeps one; without it, none."""
    from gmlx.engine.kernels import one_token

    monkeypatch.setenv("GMLX_HEAD_SPLIT", "1")
    model = _tuned_model()
    timed: list[tuple[int, int, int | None]] = []

    def clock(wins_from: int):
        def call_time(args, n, layout, hsplit):
            capacity = args[3].shape[2]
            timed.append((capacity, n, hsplit))
            assert args[0].shape == (1, 4, 1, 64) and args[3].shape == (1, 2, capacity, 64) and layout is None
            # noisy at 1,024 (the split wins there by chance), then whole until wins_from
            wins = capacity >= wins_from or capacity == 1024
            return (10e-6 if n == 1 else 12e-6) if not wins else (20e-6 if n == 1 else 15e-6)
        return call_time

    _no_choices(monkeypatch)
    try:
        monkeypatch.setattr(cached_attention_load, "_call_time", clock(4096))
        (line,) = cached_attention_load.tune_splits(model)
        at = cached_attention_load.HSPLIT_CAPACITY
        assert timed[:4] == [(at, 1, 1), (at, 1, 2), (at, 1, 2), (at, 1, 1)]  # the head split, whole
        first = cached_attention_load.TUNE_CAPACITIES[0]
        n = cached_attention_cuda.splits(2, first, 0)
        assert n > 1 and timed[4:8] == [(first, 1, None), (first, n, None), (first, n, None), (first, 1, None)]
        assert [c for c, *_ in timed[4::4]] == list(cached_attention_load.TUNE_CAPACITIES)
        assert line.startswith(f"4 heads over 2, head size 64: whole form 1 block a key-value head "
                               f"({at:,}: 20.0 / 20.0 us at 1 / 2); split from 4,096 positions at one stream")
        assert "2,048: 10.0 whole / 12.0 split us" in line
        assert cached_attention_cuda._split_keys == {(4, 2, 64, str(mx.float16)): 4096}
        assert cached_attention_cuda._layouts == {}
        assert cached_attention_cuda._hsplits == {(4, 2, 64, str(mx.float16)): (1, 1)}
        launched, attend = _launches(monkeypatch)
        attend(2048)
        attend(4096)
        attend(1024, kv=1)  # another shape: the default (from 1,024 positions)
        assert launched == [(1, False, "warp", 1, 2), (128, True, "warp", 1, 2), (32, True, "warp", 1, 1)]
        monkeypatch.setattr(cached_attention_load, "_call_time", clock(1 << 30))
        (line,) = cached_attention_load.tune_splits(model)
        assert "split from 32,768 positions" in line
        assert cached_attention_cuda._split_keys == {(4, 2, 64, str(mx.float16)): 32768}
        monkeypatch.delenv("GMLX_HEAD_SPLIT")  # the default: no head split timed or kept
        timed.clear()
        (line,) = cached_attention_load.tune_splits(model)
        assert timed[0] == (first, 1, None) and "a key-value head" not in line
        assert cached_attention_cuda._hsplits == {}
    finally:
        one_token.detach(model)


def test_the_load_times_which_layout_each_form_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the key-a-lane form agreed at the load's check, ``tune_split`` times it
    against the key-a-warp form whole (1,024 positions) and split (the longest capacity),
    each pair in the order a, b, b, a, keeps the faster for each form, and times the split
    threshold with those; ``attend_cached`` then launches each form in its layout."""
    from gmlx.engine.kernels import one_token

    model = _tuned_model()
    key = (4, 2, 64, str(mx.float16))
    timed: list[tuple[int, int, str | None]] = []

    def call_time(args, n, layout, hsplit):
        timed.append((args[3].shape[2], n, layout))
        layout = layout or cached_attention_cuda._layouts[key][n > 1]
        lane_faster = n == 1  # the lane form whole, the warp form split
        return (5e-6 if (layout == "lane") == lane_faster else 9e-6) * (1 if n == 1 else 0.5)

    _no_choices(monkeypatch, lane_agrees={key: True})
    monkeypatch.setattr(cached_attention_load, "_call_time", call_time)
    try:
        (line,) = cached_attention_load.tune_splits(model)
        longest = cached_attention_load.TUNE_CAPACITIES[-1]
        assert timed[:8] == [(1024, 1, "warp"), (1024, 1, "lane"), (1024, 1, "lane"), (1024, 1, "warp"),
                             (longest, 132, "warp"), (longest, 132, "lane"), (longest, 132, "lane"),
                             (longest, 132, "warp")]
        assert all(layout is None for *_, layout in timed[8:])  # the threshold: in the layouts taken
        assert timed[8] == (cached_attention_load.TUNE_CAPACITIES[0], 1, None)  # no head split unasked
        assert cached_attention_cuda._layouts == {key: ("lane", "warp")}
        assert "whole form a key a lane (1,024: 9.0 warp / 5.0 lane us)" in line
        assert "split form a key a warp (16,384: 2.5 warp / 4.5 lane us)" in line
        launched, attend = _launches(monkeypatch)
        attend(128)  # below the shortest capacity timed (the split won at every one)
        attend(1 << 16)
        assert launched == [(1, False, "lane", 1, 2), (132, True, "warp", 1, 2)]
    finally:
        one_token.detach(model)


@pytest.mark.parametrize("wide_wins_at", [(256, 1024), (256,)])
def test_the_load_times_one_streams_whole_form_against_the_wide_one(monkeypatch: pytest.MonkeyPatch,
                                                                    wide_wins_at: tuple[int, ...]) -> None:
    """Where the wide form agreed at the load's check, ``tune_split`` times one stream's
    whole form as chosen so far against it at each of ``WIDE_CAPACITIES`` (a, b, b, a)
    and takes it only where it won at each; ``attend_cached`` then launches one stream's
    whole form wide (a query head a block), never a batch's or a split one."""
    from gmlx.engine.kernels import one_token

    model = _tuned_model()
    key = (4, 2, 64, str(mx.float16))
    timed: list[tuple[int, int, str | None]] = []

    def call_time(args, n, layout, hsplit):
        capacity = args[3].shape[2]
        timed.append((capacity, n, layout))
        if n > 1:
            return 15e-6
        wide = layout == "wide" or (layout is None and cached_attention_cuda._wide.get(key, False))
        return (8e-6 if capacity in wide_wins_at else 30e-6) if wide else 20e-6

    _no_choices(monkeypatch, wide_agrees={key: True})
    monkeypatch.setattr(cached_attention_load, "_call_time", call_time)
    try:
        (line,) = cached_attention_load.tune_splits(model)
        assert timed[:8] == [(256, 1, None), (256, 1, "wide"), (256, 1, "wide"), (256, 1, None),
                             (1024, 1, None), (1024, 1, "wide"), (1024, 1, "wide"), (1024, 1, None)]
        took = wide_wins_at == (256, 1024)
        assert cached_attention_cuda._wide == {key: took}
        assert (f"one stream's whole form {'wide' if took else 'as above'} (256: 20.0 / 8.0 wide us, "
                f"1,024: 20.0 / {8.0 if took else 30.0} wide us)") in line
        launched, attend = _launches(monkeypatch)
        attend(128)  # one stream, whole
        attend(128, batch=2)
        attend(1 << 16)  # one stream, split
        assert launched == [(1, False, "wide" if took else "warp", 2 if took else 1, 4 if took else 2),
                            (1, False, "warp", 1, 4), (132, True, "warp", 1, 2)]
        with pytest.raises(ValueError, match="whole only"):
            k = mx.zeros((1, 2, 64, 64), mx.float16)
            cached_attention_cuda.attend_cached(mx.zeros((1, 4, 1, 64), mx.float16), k[..., :1, :], k[..., :1, :],
                                                k, k, mx.zeros((1,), mx.int32), mx.array([7], mx.int32), 0.125,
                                                n=2, layout="wide")
    finally:
        one_token.detach(model)


def test_the_load_times_the_wide_forms_launch_shapes_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``GMLX_ATTENTION_WIDE_SHAPES=1``, where the wide form agreed at the load's
    check, ``tune_split`` checks each of its other launch shapes against MLX (one that
    fails, as a launch whose registers a block cannot hold would, is left out and
    logged), times those left at each of ``WIDE_CAPACITIES`` (a, b, ..., b, a; the clock
    a stand-in here: no GPU), keeps the least total, then times the wide form in that
    shape against the whole form as before and checks the folded ropes again in it;
    ``attend_cached`` then launches one stream's wide form in that shape (its warps a
    block, its keys in flight). Without the setting none of this is timed."""
    from gmlx.engine.kernels import one_token

    model = _tuned_model()
    key = (4, 2, 64, str(mx.float16))
    shapes = cached_attention_cuda.wide_shapes(64)
    timed: list[tuple] = []
    checked: list[tuple] = []
    refolded: list = []
    fastest = (16, 4)

    def check(heads, kv_heads, d, scale, dtype, capacity, n, hsplit=1, layout="warp", rope=None, **shape):
        checked.append((capacity, layout, shape.get("warps"), shape.get("in_flight")))
        if (shape.get("warps"), shape.get("in_flight")) == shapes[-1]:
            raise RuntimeError("too many resources requested for launch")

    def call_time(args, n, layout, hsplit, **shape):
        timed.append((args[3].shape[2], n, layout, shape.get("warps"), shape.get("in_flight")))
        if n > 1:
            return 15e-6
        wide = layout == "wide"
        taken = cached_attention_cuda._wide_shapes.get(key)
        ran = (shape["warps"], shape["in_flight"]) if shape else taken
        return (6e-6 if ran == fastest else 9e-6) if wide else 20e-6

    _no_choices(monkeypatch, wide_agrees={key: True})
    monkeypatch.setattr(cached_attention_cuda, "_wide_shapes", {})
    monkeypatch.setattr(cached_attention_load, "_call_time", call_time)
    monkeypatch.setattr(cached_attention_load, "_check", check)
    monkeypatch.setattr(cached_attention_load, "check_folds", lambda m: refolded.append(m))
    try:
        (line,) = cached_attention_load.tune_splits(model)
        assert not checked and cached_attention_cuda._wide_shapes == {} and not refolded  # not asked
        assert timed[:2] == [(256, 1, None, None, None), (256, 1, "wide", None, None)]
        monkeypatch.setenv(cached_attention_cuda.WIDE_SHAPES_ENV, "1")
        timed.clear()
        (line,) = cached_attention_load.tune_splits(model)
        assert checked == [(c, "wide", w, u) for w, u in shapes[1:] for c in (32, 512)][:-1]  # the last's first check failed
        kept = shapes[:-1]
        order = [*kept, *reversed(kept)]
        assert timed[:2 * len(order)] == [(c, 1, "wide", w, u) for w, u in order for c in (256, 1024)]
        assert cached_attention_cuda._wide_shapes == {key: fastest}
        assert "the wide form 16 warps a block, 4 key(s) in flight (32x1: 18.0, 32x2: 18.0, 16x4: 12.0" in line
        assert "one stream's whole form wide (256: 20.0 / 6.0 wide us" in line and cached_attention_cuda._wide[key]
        assert refolded == [model]
        launched: list = []
        monkeypatch.setattr(cached_attention_cuda, "_kernel", lambda *a, **kw: (a[5], a[8], kw.get("warps")))
        monkeypatch.setattr(attention_cuda, "in_blocks",
                            lambda kernel, inputs, q, n, blocks, out_shape, threads: launched.append(
                                (*kernel(False), blocks, threads)))
        k = mx.zeros((1, 2, 128, 64), mx.float16)
        cached_attention_cuda.attend_cached(mx.zeros((1, 4, 1, 64), mx.float16), k[..., :1, :], k[..., :1, :],
                                            k, k, mx.zeros((1,), mx.int32), mx.array([7], mx.int32), 0.125)
        assert launched == [("wide", 4, 16, 4, 16 * 32)]
    finally:
        one_token.detach(model)


def test_the_load_times_how_many_blocks_share_a_key_value_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a key-value head has several query heads, ``tune_split`` times the whole form
    with the group in one block, two and four (:func:`hsplits`) at 1,024 positions, in
    the order a, b, c, c, b, a, keeps the fastest for the whole form (the split form keeps
    one block a key-value head) and times the split threshold with it; ``attend_cached``
    then launches one stream's whole form so (a batch's only where asked), counting its
    blocks for the wave a batch fills (a batch whose blocks fill one stays whole), and
    the split form's toward the target."""
    from gmlx.engine.kernels import one_token

    assert cached_attention_cuda.hsplits(1) == (1,)  # nothing to share: nothing timed
    assert cached_attention_cuda.hsplits(4) == (1, 2, 4) and cached_attention_cuda.hsplits(6) == (1, 2, 3, 6)
    monkeypatch.setenv("GMLX_HEAD_SPLIT", "1")  # off by default (the module says why)
    model = _tuned_model(8)
    key = (8, 2, 64, str(mx.float16))
    timed: list[tuple[int, int, int]] = []

    def call_time(args, n, layout, hsplit):
        hsplit = hsplit or cached_attention_cuda._hsplits[key][n > 1]
        timed.append((args[3].shape[2], n, hsplit))
        # whole: the serial chain a block's keys, shorter a query head fewer; split: flat
        return args[3].shape[2] / 256 * 20e-6 / hsplit if n == 1 else 15e-6

    _no_choices(monkeypatch)
    monkeypatch.setattr(cached_attention_load, "_call_time", call_time)
    try:
        (line,) = cached_attention_load.tune_splits(model)
        assert timed[:6] == [(1024, 1, 1), (1024, 1, 2), (1024, 1, 4), (1024, 1, 4), (1024, 1, 2), (1024, 1, 1)]
        assert cached_attention_cuda._hsplits == {key: (4, 1)}
        assert "whole form 4 blocks a key-value head (1,024: 80.0 / 40.0 / 20.0 us at 1 / 2 / 4)" in line
        assert all(hsplit == (4 if n == 1 else 1) for _, n, hsplit in timed[6:])  # the threshold with the choice
        assert "split from 1,024 positions" in line and "512: 10.0 whole / 15.0 split us" in line
        launched, attend = _launches(monkeypatch)
        attend(512, heads=8)  # one stream, short: whole, a query head a block
        attend(2048, heads=8)  # long: split, one block a key-value head, toward the target
        assert cached_attention_cuda.splits(20 * 2, 2048) == 7 and cached_attention_cuda.splits(20 * 2 * 4, 2048) == 1
        attend(512, heads=8, batch=8)  # a batch: one block a key-value head (8 streams lost with more)
        attend(2048, heads=8, batch=20)  # 40 blocks: split
        attend(2048, heads=8, batch=20, hsplit=4)  # 160 blocks whole: a wave of the SMs filled, no split
        attend(512, heads=8, hsplit=2)  # as the caller asks
        assert launched == [(1, False, "warp", 4, 8), (64, True, "warp", 1, 2), (1, False, "warp", 1, 16),
                            (7, True, "warp", 1, 40), (1, False, "warp", 4, 160), (1, False, "warp", 2, 4)]
        with pytest.raises(ValueError, match="a head split of 3 for 4 query heads"):
            attend(512, heads=8, hsplit=3)
        monkeypatch.delenv("GMLX_HEAD_SPLIT")  # the default: one block a key-value head
        launched.clear()
        attend(512, heads=8)
        assert launched == [(1, False, "warp", 1, 2)]
    finally:
        one_token.detach(model)


def test_which_steps_take_the_cached_kernel() -> None:
    q, k_new, v_new, k, v, _ = _cached_state(2, 8, 2, 64, 10, 128, [0, 3], mx.bfloat16)
    mask = mx.ones((2, 1, 1, 11), dtype=mx.bool_)
    assert cached_attention_cuda.supports_cached(q, k_new, v_new, k, v, None, 11)
    assert cached_attention_cuda.supports_cached(q, k_new, v_new, k, v, mask, 11)  # the batch's padding
    assert not cached_attention_cuda.supports_cached(q, k_new, v_new, k, v, mask[..., 3:], 11)  # a window: 8 of 11 keys
    assert not cached_attention_cuda.supports_cached(q, k_new, v_new, k, v, mask, 12)
    assert not cached_attention_cuda.supports_cached(q, k_new, v_new, k, v, "causal", 11)
    assert not cached_attention_cuda.supports_cached(q, k_new, v_new, k, v, mask.astype(mx.float16), 11)  # additive
    assert not cached_attention_cuda.supports_cached(q, k_new, v_new, k.astype(mx.float16), v.astype(mx.float16), None, 11)
    assert not cached_attention_cuda.supports_cached(q[..., :96], k_new[..., :96], v_new[..., :96], k[..., :96],
                                              v[..., :96], None, 11)  # head size 96
    two = mx.concatenate([k_new, k_new], axis=2)
    assert not cached_attention_cuda.supports_cached(q, two, two, k, v, None, 11)  # two positions a step
    assert not cached_attention_cuda.supports_cached(q[:, :5], k_new, v_new, k, v, None, 11)  # 5 heads over 2
    assert not cached_attention_cuda.supports_cached(q.astype(mx.float32), *(a.astype(mx.float32) for a in
                                                                      (k_new, v_new, k, v)), None, 11)
    q24, k1, v1, kc, vc, _ = _cached_state(1, 24, 2, 64, 10, 128, [0], mx.bfloat16)
    assert not cached_attention_cuda.supports_cached(q24, k1, v1, kc, vc, None, 11)  # 12 heads of 128 a group: no room
    q22 = q24[:, :22]
    assert cached_attention_cuda.supports_cached(q22, k1, v1, kc, vc, None, 11)  # 11 fit in the warps' 48 KB


def test_a_load_checks_each_folded_rope_and_keeps_the_layers_own_where_it_disagrees(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With the rope folded in (``GMLX_ROPE_ATTENTION``), the load runs the kernel with it
    whole and split in each layout it may take, against the layer's own rope and MLX's
    attention (the kernel's place taken by its arithmetic in numpy, the rotation in MLX as
    the kernel computes it); a kernel that does not rotate leaves every layer its own
    rope, with a warning."""
    import logging

    from mlx_lm.models.llama import Model, ModelArgs

    from gmlx.engine.kernels import one_token
    from tests.engine.kernels.models import rotated

    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64,
                            rope_theta=500000.0))
    model.set_dtype(mx.float16)
    one_token.attach(model, in_place=True, fold=True)
    replaying = _cached_replaying([])
    ropes: list[tuple] = []

    def folding(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None,
                rotate=True):
        ropes.append((rope is not None and rope[2], n, layout))
        if rope is not None and rotate:
            q, k_new = (rotated(a, *rope) for a in (q, k_new))
        return replaying(q, k_new, v_new, k, v, padding, position, scale)

    monkeypatch.setattr(cached_attention_cuda, "_lane_agrees", {(2, 1, 64, str(mx.float16)): True})
    monkeypatch.setattr(cached_attention_cuda, "_wide_agrees", {(2, 1, 64, str(mx.float16)): True})
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", folding)
    assert cached_attention_load.check_folds(model) == 1  # two layers, one rope
    assert ropes == [("half", 1, "warp"), ("half", 16, "warp"), ("half", 1, "lane"), ("half", 16, "lane"),
                     ("half", 1, "wide")]  # (the wide form whole only)
    assert all(layer.self_attn._fold is not None for layer in model.layers)
    monkeypatch.setattr(cached_attention_cuda, "attend_cached",
                        lambda *a, **kw: folding(*a, **kw, rotate=False))  # handed the rope, rotates nothing
    with caplog.at_level(logging.WARNING, logger=cached_attention_load.__name__):
        assert cached_attention_load.check_folds(model) == 1
    assert "does not take the rope (2 layers keep their own)" in caplog.text
    assert all(layer.self_attn._fold is None for layer in model.layers)


def test_a_qwen2_models_in_place_attention_is_compiled_at_the_load_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen2's attention layers keep no ``head_dim``: the load reads the head size from
    the query projection, so their in-place attention is compiled and checked before the
    model is ready (it was not, and no step of theirs was traced whole), its rope folded
    in where asked."""
    from gmlx.engine.kernels import one_token
    from tests.engine.kernels.models import tiny

    model = tiny("qwen2", 2, dtype=mx.float16, heads=2)  # heads of 64, as the kernel takes them
    assert not hasattr(model.layers[0].self_attn, "head_dim")
    one_token.attach(model, in_place=True, fold=True)
    assert all(layer.self_attn._fold is not None for layer in model.layers)
    replaying = _cached_replaying([])
    calls: list[tuple] = []

    def recorded(q, k_new, v_new, k, v, padding, position, scale, n=None, layout=None, hsplit=None, rope=None):
        calls.append((q.shape[1:], rope is not None))
        return replaying(q, k_new, v_new, k, v, padding, position, scale, rope=rope)

    monkeypatch.setattr(cached_attention_cuda, "_lane_agrees", {})
    monkeypatch.setattr(cached_attention_cuda, "_wide_agrees", {})
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", recorded)
    assert cached_attention_load.compile_cached(model) == 1
    assert {shape for shape, _ in calls} == {(2, 1, 64)} and any(folded for _, folded in calls)
    assert all(layer.self_attn._fold is not None for layer in model.layers)  # the folded rope agreed


def _cached_replaying(calls: list[int]):
    """``attend_cached``'s place taken by numpy (no CUDA here): the write into the cache's
    own buffers (``np.array(copy=False)`` is a view of an evaluated MLX array on the CPU),
    then the kernel's arithmetic replayed over the keys so far (the queries and key
    rotated first in MLX, as the kernel rotates them, where a rope is folded in)."""
    from tests.engine.kernels.models import rotated

    def attend_cached(q, k_new, v_new, k, v, padding, position, scale, n=None, rope=None):
        if rope is not None:
            q, k_new = (rotated(a, *rope) for a in (q, k_new))
        mx.eval(q, k_new, v_new, k, v, padding, position)
        at = position.item()
        calls.append(at)
        keys, values = np.array(k, copy=False), np.array(v, copy=False)
        keys[:, :, at] = np.array(k_new)[:, :, 0]
        values[:, :, at] = np.array(v_new)[:, :, 0]
        b, heads, _, d = q.shape
        mask = (np.arange(at + 1)[None] >= np.array(padding)[:, None]).reshape(b, 1, 1, at + 1)
        out = attention_cuda.replay(np.array(q.astype(mx.float32)), keys[:, :, :at + 1].astype(np.float32),
                                    values[:, :, :at + 1].astype(np.float32), scale, mask)
        return mx.array(out).astype(q.dtype).reshape(b, 1, heads * d)

    return attend_cached


def test_a_padded_batch_decodes_through_the_cached_kernel_as_through_the_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded batch's decode steps over gmlx's batch cache, with the cached kernel
    (its numpy stand-in) writing in place: the logits of every step, and the cache's
    arrays, positions and offsets after, are those of mlx-lm's writes and MLX's
    attention; the arrays grow past a whole step on the way; prompt steps keep the
    cache's own writes."""
    from mlx_lm.models.llama import Model, ModelArgs

    from gmlx.engine.kernels import one_token
    from gmlx.engine.prompt_cache import _AlignedBatchKVCache

    mx.random.seed(5)
    model = Model(ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64))
    model.set_dtype(mx.float16)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 16, 17, 18]]

    def decode(in_place: bool):
        # (the rope folded in is checked by its own tests: the stand-in here does not rotate)
        one_token.attach(model, rotation=lambda attention: None, in_place=in_place, fold=False)
        try:
            cache = [_AlignedBatchKVCache([0, 4]) for _ in model.layers]
            for c in cache:
                c.step = 4  # the arrays grow every few steps
            model(mx.array(prompts), cache=cache)
            steps = [model(mx.array([[20 + i], [30 + i]]), cache=cache)[:, -1, :].astype(mx.float32)
                     for i in range(6)]
            return steps, cache
        finally:
            one_token.detach(model)

    want, cache_want = decode(False)
    calls: list[int] = []
    monkeypatch.setattr(cached_attention_cuda, "attend_cached", _cached_replaying(calls))
    got, cache_got = decode(True)
    assert calls == [at for at in range(7, 13) for _ in model.layers]
    for g, w in zip(got, want, strict=True):
        assert mx.allclose(g, w, atol=2e-2).item()
    for layer, (g, w) in enumerate(zip(cache_got, cache_want, strict=True)):
        assert g._idx == w._idx == 13 and g.keys.shape == w.keys.shape
        assert mx.array_equal(g.offset, w.offset).item()
        # the first layer's keys and values come from the tokens alone: the same bits;
        # the second's from the first's attention, whose rounding the replay's is not
        same = mx.array_equal if layer == 0 else (lambda a, b: mx.allclose(a, b, atol=2e-2))
        assert same(g.keys[..., :13, :], w.keys[..., :13, :]).item()
        assert same(g.values[..., :13, :], w.values[..., :13, :]).item()


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d,rope,splits,hsplit", [
    (mx.bfloat16, 128, nn.RoPE(128, base=500000.0), 1, 1),
    (mx.float16, 64, nn.RoPE(64, traditional=True, base=10000.0), 3, 1),
    (mx.bfloat16, 64, nn.RoPE(64, base=10000.0, scale=0.5), 1, 2),
    (mx.bfloat16, 128, "llama3", 2, 1)])
@pytest.mark.parametrize("layout", cached_attention_cuda.LAYOUTS)
def test_the_cached_kernel_with_the_rope_folded_in_rotates_as_mlx_does(
        tmp_path: Path, dtype, d: int, rope, splits: int, hsplit: int, layout: str) -> None:
    """The layer's rope folded into the in-place attention: handed the step's queries and
    key as the projections made them and each stream's position (far apart: 3, 290 and
    70,000, the last past float16's whole numbers' step), it attends as MLX's rope then
    attention do, and the cache takes the key as MLX's rope rounds it, bit for bit (both
    pairings; llama 3's frequencies; whole, split and a head split)."""
    if rope == "llama3":
        from mlx_lm.models.rope_utils import Llama3RoPE

        rope = Llama3RoPE(d, max_position_embeddings=131072, base=500000.0, scaling_config={
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    offset = mx.array([3, 290, 70000], dtype=mx.int32)
    _cached_matches_mlx(tmp_path, (3, 8, 2, 512, 300, d, [0, 17, 290], dtype), splits, layout, hsplit, (rope, offset))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("layout,in_flight,dense,splits", [("warp", 1, True, 1), ("warp", 2, False, 3),
                                                           ("lane", 4, True, 1), ("lane", 8, True, 2)])
def test_the_shorter_builds_attend_as_mlx_does(tmp_path: Path, layout: str, in_flight: int, dense: bool,
                                               splits: int) -> None:
    """``GMLX_ATTENTION_IN_FLIGHT`` / ``GMLX_ATTENTION_DENSE``'s builds (fewer keys in
    flight, no strided path): the same attention and the same write as the default's,
    whole and split, a stream padded past a whole unroll."""
    _cached_matches_mlx(tmp_path, (3, 8, 2, 512, 300, 128, [0, 17, 290], mx.bfloat16), splits, layout, 1, None,
                        (in_flight, dense))


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("layout", cached_attention_cuda.LAYOUTS)
def test_a_dense_build_handed_a_strided_cache_answers_nan_and_writes_nothing(tmp_path: Path, layout: str) -> None:
    """The dense-only build reads rows as wide loads: handed a cache whose rows are not
    dense it must not answer wrong, so every output is NaN and the cache is untouched."""
    q, k_new, v_new, k, v, pad = _cached_state(2, 4, 2, 64, 20, 64, [0, 3], mx.float16)
    got, k_after, v_after, stores = _run_cached_source(
        tmp_path, q, k_new, v_new, k, v, pad, 20, 0.125, 1, layout, 1, None, (0, True),
        "(int64_t)HK * C * D, (int64_t)C * D, D + 4, 1")  # rows 68 apart: not 16-byte aligned
    assert mx.isnan(got).all().item()
    assert mx.array_equal(k_after, k).item() and mx.array_equal(v_after, v).item() and (stores == 0).all()
    got, *_ = _run_cached_source(tmp_path, q, k_new, v_new, k, v, pad, 20, 0.125, 1, layout, 1, None, (0, False),
                                 "(int64_t)HK * C * D, (int64_t)C * D, D, 1")
    assert not mx.isnan(got).any().item()  # the same call as dense rows: an answer
