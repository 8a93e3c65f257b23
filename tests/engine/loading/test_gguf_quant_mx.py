"""``gguf_quant_mx`` (the conversion as MLX operations, used on a GPU) against the numpy
path of ``gguf_quant``: the same bytes in weight, scales and biases and the same max
error, for every type with an MLX form and every scale dtype. Here MLX runs on the CPU,
so the GPU path is forced; on CUDA ``benchmarks/convert_speed.py --check`` compares both
on the device."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import random_blocks
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from gmlx.engine.loading import gguf_quant, gguf_quant_mx
from gmlx.engine.loading.gguf_quant import QuantizedTensor

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K]


def _bytes(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _both(raw: np.ndarray, qtype: GGMLQuantizationType, dtype: mx.Dtype,
          monkeypatch: pytest.MonkeyPatch) -> tuple[QuantizedTensor, QuantizedTensor]:
    monkeypatch.setattr(gguf_quant_mx, "wanted", lambda: False)
    host = gguf_quant.convert(raw, qtype, dtype)
    monkeypatch.setattr(gguf_quant_mx, "wanted", lambda: True)
    device = gguf_quant.convert(raw, qtype, dtype)
    assert isinstance(host, QuantizedTensor) and isinstance(device, QuantizedTensor)
    return host, device


def assert_identical(host: QuantizedTensor, device: QuantizedTensor) -> None:
    assert (device.bits, device.group_size, device.max_error) == (host.bits, host.group_size, host.max_error)
    for name in ("weight", "scales", "biases"):
        a, b = getattr(device, name), getattr(host, name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert _bytes(a) == _bytes(b), name


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_device_path_matches_the_host_path(
    qtype: GGMLQuantizationType, dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = random_blocks(qtype, 96, 512, seed=int(qtype))
    monkeypatch.setattr(gguf_quant_mx, "CHUNK_ELEMENTS", 512 * 7)  # many chunks, the last short
    host, device = _both(raw, qtype, dtype, monkeypatch)
    assert_identical(host, device)
    if qtype in gguf_quant.REQUANT_BITS:
        assert host.max_error is not None and host.max_error > 0


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_device_path_on_quantized_weights(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real quantizer output (the types the ``gguf`` package quantizes), not random bytes."""
    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    w[0] = 0.25  # a constant row
    raw = gguf_quants.quantize(w, qtype)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        assert_identical(*_both(raw, qtype, dtype, monkeypatch))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_requantization_ties_and_flat_groups(dtype: mx.Dtype) -> None:
    """Values halfway between two codes (round half to even, as ``np.rint``) and groups
    with an empty range give the host's codes, scales, biases and error."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    w[0] = 0.75  # flat groups
    # a group spanning 0..63 at 6 bits has scale 1: k + 0.5 falls exactly between codes
    w[1, :32] = np.concatenate([[0.0, 63.0], np.arange(30) + 0.5]).astype(np.float32)
    w[2, :32] = np.concatenate([[0.0, 15.0], (np.arange(30) % 15) + 0.5]).astype(np.float32)
    for bits in (4, 6):
        host = gguf_quant.affine_quantize(w, bits, dtype)
        weight, scale, bias, error = gguf_quant_mx.affine(mx.array(w), bits, dtype)
        assert np.array(weight).tobytes() == host[0].tobytes()
        assert np.array(scale).tobytes() == host[1].tobytes()
        assert np.array(bias).tobytes() == host[2].tobytes()
        assert error.item() == host[3]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_matches_the_host(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(37, 256), dtype=np.uint8)
    device = gguf_quant_mx.pack_codes(mx.array(codes), bits)
    assert device.dtype == mx.uint32
    assert np.array(device).tobytes() == gguf_quant.pack_codes(codes, bits).tobytes()


def test_wanted_only_on_a_gpu_and_not_when_told_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GMLX_CONVERT_ON", raising=False)
    assert gguf_quant_mx.wanted() == (mx.default_device().type == mx.DeviceType.gpu)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))  # as on Metal or CUDA
    assert gguf_quant_mx.wanted()
    monkeypatch.setenv("GMLX_CONVERT_ON", "host")
    assert not gguf_quant_mx.wanted()
