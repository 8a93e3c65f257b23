"""The residual add and RMSNorm of a one-token step fused (``add_norm_cuda``): the
kernel's own source against MLX's add and norm, run on the CPU with CUDA's block
primitives emulated (MLX has no CUDA backend here); the wiring through real llama-pattern
models with MLX's own add and norm standing in for the kernel (the same logits, bit for
bit: the wiring changes nothing else), and which steps take it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from gmlx.engine.kernels import add_norm_cuda
from tests.engine.kernels import emulation
from tests.engine.kernels.emulation import PRELUDE, compile_and_run
from tests.engine.kernels.models import steps, tiny

LAYERS = 3

_PROGRAM = PRELUDE + r"""
using E = ELEMENT;
void kernel(const E* x, const E* r, const E* w, E* h, E* out) {
BODY
}
int main(int argc, char** argv) {
    const int rows = std::atoi(argv[1]), D = std::atoi(argv[2]), THREADS_ = std::atoi(argv[3]);
    auto x = load<E>("x.bin", (size_t)rows * D);
    auto r = load<E>("r.bin", (size_t)rows * D);
    auto w = load<E>("w.bin", (size_t)D);
    std::vector<E> h((size_t)rows * D), out((size_t)rows * D);
    run_blocks(rows, THREADS_, [&] { kernel(x.data(), r.data(), w.data(), h.data(), out.data()); });
    save("h.bin", h);
    save("out.bin", out);
}
"""


def _source(dtype, d: int, eps: float) -> str:
    made: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
        add_norm_cuda._kernel.cache_clear()
        try:
            add_norm_cuda._kernel(dtype, d, eps)
        finally:
            add_norm_cuda._kernel.cache_clear()
    assert made[0]["output_names"] == ["h", "out"]
    return made[0]["source"]


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("dtype,d", [(mx.bfloat16, 320), (mx.float16, 4096), (mx.bfloat16, 96)])
def test_the_kernel_source_itself_matches_mlx(tmp_path: Path, dtype, d: int) -> None:
    """Rows wider than the block (a tail of 64), an 8B's width, and narrower than it."""
    mx.random.seed(d)
    rows, eps = 3, 1e-5
    x = (mx.random.normal((rows, d)) * 4).astype(dtype)
    r = mx.random.normal((rows, d)).astype(dtype)
    w = (1 + mx.random.normal((d,)) * 0.1).astype(dtype)
    element = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}[dtype]
    for name, a in (("x", x), ("r", r), ("w", w)):
        (tmp_path / f"{name}.bin").write_bytes(np.array(a.view(mx.uint16)).tobytes())
    program = _PROGRAM.replace("ELEMENT", element).replace("BODY", _source(dtype, d, eps))
    compile_and_run(tmp_path, program, [rows, d, add_norm_cuda.THREADS])
    h, out = (mx.array(np.frombuffer((tmp_path / f"{n}.bin").read_bytes(), dtype=np.uint16).reshape(rows, d))
              .view(dtype) for n in ("h", "out"))
    want_h, want_out = add_norm_cuda.mlx_add_norm(x, r, w, eps)
    assert mx.array_equal(h, want_h).item()  # the sum rounds as MLX's add does
    err = mx.abs(out.astype(mx.float32) - want_out.astype(mx.float32)).max().item()
    exact = mx.fast.rms_norm(want_h.astype(mx.float32), w.astype(mx.float32), eps)
    mlx_err = mx.abs(want_out.astype(mx.float32) - exact).max().item()
    assert err <= 2 * mlx_err + 1e-3 * mx.abs(exact).max().item(), (err, mlx_err)


def _model(family: str) -> nn.Module:
    return tiny(family, LAYERS, dtype=mx.bfloat16, seed=7)  # the kernel's activations: bf16 or fp16


@pytest.mark.parametrize("family", add_norm_cuda.FAMILIES)
@pytest.mark.parametrize("batch", [False, True])
def test_the_wiring_gives_the_same_logits(family: str, batch: bool) -> None:
    """With MLX's own add and norm in the kernel's place, a model with the fused blocks
    computes what it computed: the next block (and the final norm) take the last block's
    sum as its two parts, prompt steps run the model's own code."""
    model = _model(family)
    prompts = (mx.array([[3, 1, 4, 1, 5, 9], [0, 0, 2, 7, 1, 8]]) if batch else mx.array([[3, 1, 4, 1, 5, 9]]))

    def caches() -> list:
        return [BatchKVCache([0, 2]) for _ in range(LAYERS)] if batch else make_prompt_cache(model)

    want = steps(model, caches(), prompts)
    calls: list[tuple[int, ...]] = []

    def fused(x, r, w, eps):
        calls.append(tuple(x.shape))
        return add_norm_cuda.mlx_add_norm(x, r, w, eps)

    assert add_norm_cuda.attach(model, fused) == LAYERS
    got = steps(model, caches(), prompts)
    for a, b in zip(want, got, strict=True):
        assert mx.array_equal(a, b).item()
    rows = prompts.shape[0]
    # per decode step: two a block (the first block's input is the embedding), one for the final norm
    assert calls == [(rows, 1, 128)] * (2 * LAYERS) * 4
    add_norm_cuda.detach(model)
    assert not any(getattr(type(m), "add_norm", False) for _, m in model.named_modules())


def test_the_block_sums_nobody_reads_are_never_evaluated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block still builds the sum it hands on, but the next block and the final norm
    read its parts: the sums are not in the step's graph (from the logits back), so MLX
    never evaluates them. (The sums are made another operation here, to be told apart from
    the additions the stand-in for the kernel makes.)"""
    model = _model("llama")
    add_norm_cuda.attach(model, add_norm_cuda.mlx_add_norm)
    built: list[mx.array] = []

    def hand_on(h, r):
        built.append(out := mx.logaddexp(h, r))
        return out

    monkeypatch.setattr(add_norm_cuda, "_hand_on", hand_on)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[3, 1, 4]]), cache=cache))  # a prompt step: the model's own code
    assert not built
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), model(mx.array([[7]]), cache=cache))
    assert len(built) == LAYERS
    assert 'label ="LogAddExp"' not in dot.read_text()
