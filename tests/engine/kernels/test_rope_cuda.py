"""A one-token step's queries and keys rotated in one kernel (``rope_cuda``): the kernel's
own source against MLX's rope, run on the CPU with CUDA's block primitives emulated (MLX
has no CUDA backend here), for the rope modules it stands in for; the wiring through
real models with MLX's reshapes and rope in the kernel's place (the same logits, bit for
bit); and which layers take it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from gmlx.engine.kernels import one_token, rope_cuda
from tests.engine.kernels import emulation
from tests.engine.kernels.models import steps, tiny

LAYERS = 3

_MAIN = r"""
int main(int argc, char** argv) {
    const int B = std::atoi(argv[1]), H = std::atoi(argv[2]), HK_ = std::atoi(argv[3]), D_ = std::atoi(argv[4]);
    auto q = load<E>("q.bin", (size_t)B * H * D_);
    auto k = load<E>("k.bin", (size_t)B * HK_ * D_);
    auto off = load<int32_t>("off.bin", (size_t)B);
    auto inv = load<float>("inv.bin", (size_t)D_ / 2);
    auto qw = load<E>("qw.bin", (size_t)D_);
    auto kw = load<E>("kw.bin", (size_t)D_);
    std::vector<E> qo((size_t)B * H * D_), ko((size_t)B * HK_ * D_);
    Shape off_shape{B};
    const int threads = B * (H + HK_) * 32;
    run_blocks((threads + 127) / 128, 128, [&] { kernel(ARGS); });
    save("qo.bin", qo);
    save("ko.bin", ko);
}
"""

ROPES = {
    "plain": lambda: nn.RoPE(64, base=10000.0),
    "traditional, scaled": lambda: nn.RoPE(64, traditional=True, base=500000.0, scale=0.5),
    "llama 3": lambda: Llama3RoPE(64, max_position_embeddings=8192, base=500000.0, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("name", [*ROPES, "llama 3, normed heads"])
def test_the_kernel_source_itself_matches_mlx(tmp_path: Path, name: str) -> None:
    """Three streams at positions 0, 5 and 3,000 (a long context's angles), 4 query and
    2 key-value heads of 64, bf16; with qwen3's per-head norms first in the last case."""
    normed = name.endswith("normed heads")
    rope = ROPES[name.removesuffix(", normed heads")]()
    heads, kv_heads, d, b, eps = 4, 2, 64, 3, 1e-6
    mx.random.seed(len(name))
    q = (mx.random.normal((b, 1, heads * d)) * 3).astype(mx.bfloat16)
    k = mx.random.normal((b, 1, kv_heads * d)).astype(mx.bfloat16)
    qw, kw = ((1 + mx.random.normal((d,)) * 0.2).astype(mx.bfloat16) for _ in range(2))
    offset = mx.array([0, 5, 3000], dtype=mx.int32)
    inv, traditional = rope_cuda.inverse_frequencies(rope, d)
    made: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
        rope_cuda._kernel.cache_clear()
        try:
            rope_cuda._kernel(mx.bfloat16, heads, kv_heads, d, traditional, eps if normed else None)
        finally:
            rope_cuda._kernel.cache_clear()
    types = ["bfloat16", "bfloat16", "int32", "float32", *(["bfloat16"] * 2 if normed else [])]
    function = emulation.function(made[0], types, "bfloat16")
    args = "q.data(), k.data(), off.data(), off_shape, inv.data(), " + ("qw.data(), kw.data(), " if normed else "")
    program = (emulation.PRELUDE + "using E = __nv_bfloat16;\n" + function
               + _MAIN.replace("ARGS", args + "qo.data(), ko.data()"))
    for fname, a in (("q", q.view(mx.uint16)), ("k", k.view(mx.uint16)), ("off", offset), ("inv", inv),
                     ("qw", qw.view(mx.uint16)), ("kw", kw.view(mx.uint16))):
        (tmp_path / f"{fname}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [b, heads, kv_heads, d])
    got = [mx.array(np.frombuffer((tmp_path / f"{n}.bin").read_bytes(), dtype=np.uint16)).view(mx.bfloat16)
           .reshape(b, h, 1, d) for n, h in (("qo", heads), ("ko", kv_heads))]
    for x, g, h, w in ((q, got[0], heads, qw), (k, got[1], kv_heads, kw)):
        x = x.reshape(b, h, 1, d)
        if normed:
            x = mx.fast.rms_norm(x, w, eps)  # MLX's norm, in bf16 as the model runs it
        want = rope(x.astype(mx.float32), offset=offset)  # MLX's rope in float32: the reference
        err = mx.abs(g.astype(mx.float32) - want).max().item()
        assert err <= 2e-2 * mx.abs(want).max().item(), err  # bf16 outputs: a rounding or two


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_wiring_gives_the_same_logits(family: str) -> None:
    """With MLX's reshapes and rope in the kernel's place, a padded batch decodes what
    it decoded (the batch caches' offsets are arrays: the steps the kernel takes)."""
    model = tiny(family, LAYERS, dtype=mx.bfloat16, heads=2)  # heads of 64
    prompts = mx.array([[3, 1, 4, 1, 5, 9], [0, 0, 2, 7, 1, 8]])
    want = steps(model, [BatchKVCache([0, 2]) for _ in range(LAYERS)], prompts)
    calls: list[int] = []

    def counted(attention):
        rotate = rope_cuda.mlx_rotation(attention)
        return lambda q, k, offset: calls.append(1) or rotate(q, k, offset)

    assert one_token.attach(model, rotation=counted) == LAYERS
    got = steps(model, [BatchKVCache([0, 2]) for _ in range(LAYERS)], prompts)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))
    assert len(calls) == 4 * LAYERS  # every decode step's every layer; never the prompt's


def test_which_layers_take_it() -> None:
    assert rope_cuda.rotation_applies(tiny("llama", 1, heads=2).layers[0].self_attn)
    assert rope_cuda.rotation_applies(tiny("qwen2", 1, heads=2).layers[0].self_attn)
    assert rope_cuda.rotation_applies(tiny("qwen3", 1, heads=2).layers[0].self_attn)  # its heads' norms too
    assert not rope_cuda.rotation_applies(tiny("llama", 1, heads=4).layers[0].self_attn)  # heads of 32
    assert not rope_cuda.rotation_applies(tiny("phi3", 1, heads=2).layers[0].self_attn)  # one q/k/v product
    assert rope_cuda.inverse_frequencies(nn.RoPE(32), 64) is None  # a partial rotation
    assert rope_cuda.inverse_frequencies(Llama3RoPE(64, scaling_config={"factor": 8.0}), 64) is not None
