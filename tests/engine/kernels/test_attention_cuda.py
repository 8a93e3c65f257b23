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

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine import mlxlm
from gmlx.engine.kernels import attention_cuda, cuda_source
from tests.engine.kernels import emulation
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
_EMULATION = PRELUDE + r"""
using E = ELEMENT;
void kernel(const E* q, const Shape q_shape, const Strides q_strides,
            const E* k, const Shape k_shape, const Strides k_strides,
            const E* v, const Shape v_shape, const Strides v_strides,
            const bool* mask, const Shape mask_shape, const Strides mask_strides, E* out) {
BODY
}
int main(int argc, char** argv) {
    // B heads kv_heads keys capacity D threads
    int a[7]; for (int i = 0; i < 7; ++i) a[i] = std::atoi(argv[i + 1]);
    const int B = a[0], H = a[1], HK = a[2], L = a[3], C = a[4], D = a[5], THREADS_ = a[6];
    auto q = load<E>("q.bin", (size_t)B * H * D);
    auto k = load<E>("k.bin", (size_t)B * HK * C * D);
    auto v = load<E>("v.bin", (size_t)B * HK * C * D);
    auto m = load<unsigned char>("mask.bin", (size_t)B * L);
    const bool* mb = reinterpret_cast<const bool*>(m.data());
    std::vector<E> out((size_t)B * H * D);
    Shape qs{B, H, 1, D}, ks{B, HK, L, D}, ms{B, 1, 1, L};
    Strides qt{(int64_t)H * D, D, D, 1}, kt{(int64_t)HK * C * D, (int64_t)C * D, D, 1}, mt{L, L, L, 1};
    run_blocks(B * H, THREADS_, [&] {
        kernel(q.data(), qs, qt, k.data(), ks, kt, v.data(), ks, kt, mb, ms, mt, out.data());
    });
    save("out.bin", out);
}
"""


def _run_kernel_source(tmp: Path, q, k, v, mask, scale: float, capacity: int):
    """The kernel's source for ``q``'s dtype and head size, compiled with the emulation
    above and run over ``k`` and ``v`` held as the first positions of cache arrays of
    ``capacity`` positions (read through their strides, as the cache's views are; the
    positions past them hold 1e4, which would show in any output that read them)."""
    made: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
        attention_cuda._kernel.cache_clear()
        try:
            attention_cuda._kernel(q.dtype, q.shape[-1], scale)
        finally:
            attention_cuda._kernel.cache_clear()
    element = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}[q.dtype]
    source = _EMULATION.replace("ELEMENT", element).replace("BODY", made[0]["source"])
    beyond = [(0, 0), (0, 0), (0, capacity - k.shape[2]), (0, 0)]
    k_full, v_full = (mx.pad(a, beyond, constant_values=1e4) for a in (k, v))
    bits = mx.uint16
    for name, a in (("q", q), ("k", k_full), ("v", v_full)):
        (tmp / f"{name}.bin").write_bytes(np.array(a.view(bits)).tobytes())
    (tmp / "mask.bin").write_bytes(np.array(mask.reshape(-1)).astype(np.bool_).tobytes())
    b, heads, _, d = q.shape
    compile_and_run(tmp, source, [b, heads, k.shape[1], k.shape[2], capacity, d, attention_cuda.THREADS])
    raw = np.frombuffer((tmp / "out.bin").read_bytes(), dtype=np.uint16).reshape(q.shape)
    return mx.array(raw).view(q.dtype)


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
