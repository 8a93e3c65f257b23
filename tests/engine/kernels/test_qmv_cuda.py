"""The decode-sized quantized paths: never used where they are not built. The kernel's
check against MLX's own quantized matmul on the CPU backend (same inputs, within twice
MLX's own error against a float32 product) runs on a CUDA machine:
``benchmarks/gpu/kernel_check.py``, and at every load there (``fast_linear._measure``
takes a path only where it agrees and is faster). Here: the layout the kernel reads,
replayed in numpy with the kernel's own bit arithmetic, against MLX's dequantize."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from gmlx.engine.kernels import qmv_cuda
from gmlx.engine.kernels.fast_linear import (
    FastQuantizedLinear,
    agrees,
    exact_product,
    use_fast_kernels,
)


def test_which_products_may_take_the_paths() -> None:
    assert qmv_cuda.supports(1, 4096, 64, 4) and qmv_cuda.supports(32, 14336, 32, 6)
    assert qmv_cuda.supports(8, 4096, 32, 8)
    assert not qmv_cuda.supports(33, 4096, 64, 4)  # a prefill chunk: MLX's matmul
    assert not qmv_cuda.supports(1, 4096, 32, 5)  # 5-bit: MLX's kernel
    assert not qmv_cuda.supports(1, 4000, 64, 4)  # not whole groups
    assert not qmv_cuda.supports(1, 4096, 64, 4, mode="mxfp4")


def test_not_used_where_it_is_not_built() -> None:
    model = nn.Sequential(nn.Linear(256, 64))
    nn.quantize(model, group_size=64, bits=4)
    assert not qmv_cuda.available()  # this machine: MLX on the CPU (Metal is the same)
    assert use_fast_kernels(model) is None
    assert not any(isinstance(m, FastQuantizedLinear) for _, m in model.named_modules())


def _decode_like_the_kernel(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                            bits: int, group: int) -> np.ndarray:
    """Every row's weights decoded pack by pack with the kernel's arithmetic: ``W`` words
    per pack of ``P`` codes, code ``t`` at bit ``t * bits``, spilling into the next word."""
    codes_per_pack, words_per_pack = qmv_cuda.layout(bits)
    rows, words = wq.shape
    k = words * 32 // bits
    out = np.empty((rows, k), np.float32)
    mask = (1 << bits) - 1
    for n in range(rows):
        for p in range(k // codes_per_pack):
            q = [int(v) for v in wq[n, p * words_per_pack:(p + 1) * words_per_pack]]
            g = p * codes_per_pack // group
            for t in range(codes_per_pack):
                bit = t * bits
                word, sh = divmod(bit, 32)
                v = q[word] >> sh
                if sh + bits > 32:
                    v |= (q[word + 1] << (32 - sh)) & 0xFFFFFFFF
                out[n, p * codes_per_pack + t] = scales[n, g] * (v & mask) + biases[n, g]
    return out


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (6, 32), (8, 32), (8, 128)])
def test_the_kernel_reads_mlx_layout(bits: int, group: int) -> None:
    mx.random.seed(bits * group)
    w = mx.random.normal((6, 256))
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    want = np.array(mx.dequantize(wq, s, b, group_size=group, bits=bits))
    got = _decode_like_the_kernel(np.array(wq), np.array(s), np.array(b), bits, group)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_dense_path_is_the_same_product() -> None:
    mx.random.seed(1)
    w = mx.random.normal((64, 256))
    wq, s, b = mx.quantize(w, group_size=32, bits=6)
    x = mx.random.normal((3, 256))
    got = qmv_cuda.dequantized(x, wq, s, b, 32, 6)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=6)
    assert mx.allclose(got, want, atol=1e-3, rtol=1e-3)


def test_agreement_is_held_to_mlx_own_error() -> None:
    exact = mx.array([[100.0, -50.0, 3.0]])
    mlx_own = exact + mx.array([[0.2, 0.0, 0.0]])  # MLX's product is 0.2 off
    assert agrees(exact + mx.array([[0.0, 0.3, 0.0]]), mlx_own, exact)  # 0.3 <= 2 * 0.2 + 0.1
    assert not agrees(exact + mx.array([[0.0, 0.0, 1.0]]), mlx_own, exact)


def test_the_exact_product_dequantizes() -> None:
    mx.random.seed(0)
    w = mx.random.normal((64, 256))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((2, 256))
    exact = exact_product(x, wq, s, b, 64, 4)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    assert exact.dtype == mx.float32 and mx.allclose(exact, want, atol=1e-3, rtol=1e-3)


def _tiny_quantized_llama() -> nn.Module:
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=128, num_key_value_heads=2)
    mx.random.seed(0)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    return model


@pytest.fixture(autouse=True)
def _own_tuning_file(tmp_path, monkeypatch) -> None:
    """Each test tunes afresh: the tuner's decisions are kept per machine on disk."""
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "cache"))


def test_a_bucket_stays_only_where_the_whole_step_got_faster(monkeypatch) -> None:
    """Per-layer choices are confirmed on the model's decode step: here the step is made
    (by a stand-in clock) faster with the one-row choices and slower with the two-row
    ones, so layers keep the first and lose the second; the products themselves run for
    real (the dense path runs on the CPU too)."""
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    x = mx.random.normal((2, 64))
    before = model.layers[0].self_attn.q_proj(x)
    monkeypatch.setattr(qmv_cuda, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer: {
        1: (fast_linear.DENSE, (0, 0)), 2: (fast_linear.DENSE, (0, 0))})

    def step_time(model: nn.Module, rows: int) -> float:
        fast = any(rows in getattr(m, "paths", {}) for _, m in model.named_modules())
        return {(1, True): 0.5, (1, False): 1.0, (2, True): 1.0, (2, False): 1.0}[(rows, fast)]

    monkeypatch.setattr(fast_linear, "_step_time", step_time)
    note = use_fast_kernels(model)
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    swapped = [m for m in layers if isinstance(m, FastQuantizedLinear)]
    assert swapped and all(m.paths == {1: (fast_linear.DENSE, (0, 0))} for m in swapped)
    assert note is not None and "1: 2.00x" in note
    after = model.layers[0].self_attn.q_proj(x[:1])  # one row: the dense path
    assert mx.allclose(after, before[:1], atol=1e-4, rtol=1e-4)


def test_nothing_is_kept_when_no_step_gets_faster(monkeypatch) -> None:
    from gmlx.engine.kernels import fast_linear

    model = _tiny_quantized_llama()
    monkeypatch.setattr(qmv_cuda, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer: {1: (fast_linear.DENSE, (0, 0))})
    monkeypatch.setattr(fast_linear, "_step_time", lambda model, rows: 1.0)
    note = use_fast_kernels(model)
    assert note is not None and "none faster" in note
    assert not any(isinstance(m, FastQuantizedLinear) for _, m in model.named_modules())


def test_a_second_load_reuses_the_decisions(monkeypatch) -> None:
    """The tuner's decisions are kept per machine: a second model of the same shapes
    measures nothing and times no step, and takes the same paths."""
    from gmlx import paths
    from gmlx.engine.kernels import fast_linear

    calls = {"measure": 0, "step": 0}

    def measure(layer: nn.Module) -> dict:
        calls["measure"] += 1
        return {1: (fast_linear.DENSE, (0, 0))}

    def step_time(model: nn.Module, rows: int) -> float:
        calls["step"] += 1
        return 0.5 if any(rows in getattr(m, "paths", {}) for _, m in model.named_modules()) else 1.0

    monkeypatch.setattr(qmv_cuda, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", measure)
    monkeypatch.setattr(fast_linear, "_step_time", step_time)
    first = use_fast_kernels(_tiny_quantized_llama())
    assert calls["measure"] > 0 and calls["step"] == 2
    assert (paths.cache_dir() / "kernels" / "tuning.json").is_file()
    calls.update(measure=0, step=0)
    model = _tiny_quantized_llama()
    assert use_fast_kernels(model) == first and calls == {"measure": 0, "step": 0}
    swapped = [m for _, m in model.named_modules() if isinstance(m, FastQuantizedLinear)]
    assert swapped and all(m.paths == {1: (fast_linear.DENSE, (0, 0))} for m in swapped)


def test_a_damaged_tuning_file_is_tuned_again(monkeypatch) -> None:
    from gmlx import paths
    from gmlx.engine.kernels import fast_linear, tuning

    monkeypatch.setattr(qmv_cuda, "available", lambda: True)
    monkeypatch.setattr(fast_linear, "_measure", lambda layer: {1: (fast_linear.DENSE, (0, 0))})
    monkeypatch.setattr(fast_linear, "_step_time", lambda model, rows: 1.0)
    file = paths.cache_dir() / "kernels" / "tuning.json"
    file.parent.mkdir(parents=True)
    file.write_text("{not json")
    assert "none faster" in (use_fast_kernels(_tiny_quantized_llama()) or "")
    assert file.read_text().startswith("{") and f'"format": {tuning.FORMAT}' in file.read_text()


def test_the_step_timer_runs_a_real_decode_step() -> None:
    from gmlx.engine.kernels.fast_linear import _step_time

    assert _step_time(_tiny_quantized_llama(), 2, context=4, steps=2) > 0
