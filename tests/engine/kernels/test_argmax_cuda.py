"""The greedy step's argmax kernel (``argmax_cuda``): its own source against ``mx.argmax``,
run on the CPU with CUDA's block primitives emulated (MLX has no CUDA backend here), over
an 8B's vocabulary, rows that are not a multiple of a wide load, ties, NaNs and ``-inf``;
and the decode step's wiring, with ``mx.argmax`` standing in for the kernel."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import argmax_cuda
from tests.engine.kernels import emulation
from tests.engine.kernels.emulation import PRELUDE, compile_and_run

_PROGRAM = PRELUDE + r"""
using E = ELEMENT;
void kernel(const E* logits, const Shape logits_shape, uint32_t* out) {
BODY
}
int main(int argc, char** argv) {
    const int rows = std::atoi(argv[1]), n = std::atoi(argv[2]), threads = std::atoi(argv[3]);
    auto x = load<E>("x.bin", (size_t)rows * n);
    Shape shape{};
    shape[0] = rows;
    shape[1] = n;
    std::vector<uint32_t> out(rows, 0xdeadbeefu);
    run_blocks(rows, threads, [&] { kernel(x.data(), shape, out.data()); });
    save("out.bin", out);
}
"""

_ELEMENTS = {mx.float16: ("__half", mx.uint16), mx.bfloat16: ("__nv_bfloat16", mx.uint16), mx.float32: ("float", mx.uint32)}


def _source(dtype) -> str:
    made = emulation.made(argmax_cuda._kernel, dtype)
    assert made[0]["input_names"] == ["logits"] and made[0]["output_names"] == ["out"]
    return made[0]["source"]


def _run(tmp_path: Path, logits: mx.array) -> list[int]:
    element, bits = _ELEMENTS[logits.dtype]
    rows, n = logits.shape
    (tmp_path / "x.bin").write_bytes(np.array(logits.view(bits)).tobytes())
    program = _PROGRAM.replace("ELEMENT", element).replace("BODY", _source(logits.dtype))
    compile_and_run(tmp_path, program, [rows, n, argmax_cuda.THREADS])
    return np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.uint32).tolist()


def _rows(n: int, dtype) -> mx.array:
    """Five rows of ``n``: random; its maximum three times (the first is the answer);
    a NaN late and one early among numbers (the first NaN); all ``-inf``; the maximum last."""
    mx.random.seed(n)
    x = mx.random.normal((5, n)) * 4
    top = x[1].max().item() + 1.0
    x[1, n // 3] = top
    x[1, n // 2] = top
    x[1, n - 1] = top
    x[2, n - 2] = float("nan")
    x[2, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3] = float("-inf")
    x[4, n - 1] = x[4].max().item() + 1.0
    return x.astype(dtype)


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize("n,dtype", [(128256, mx.float16), (32003, mx.bfloat16), (151936, mx.float32), (100, mx.float16)])
def test_the_kernel_source_itself_is_mx_argmax(tmp_path: Path, n: int, dtype) -> None:
    """An 8B's vocabulary in wide loads; a row not a multiple of eight (element by
    element); float32's four a load; a row shorter than the block."""
    logits = _rows(n, dtype)
    want = mx.argmax(logits, axis=-1).tolist()
    assert want[1] == n // 3 and want[2] == 7 and want[3] == 0 and want[4] == n - 1  # the cases it is built to hold
    assert _run(tmp_path, logits) == want


def test_it_takes_two_dimensional_floating_rows_only() -> None:
    assert argmax_cuda.supports(mx.zeros((3, 10), dtype=mx.bfloat16))
    assert argmax_cuda.supports(mx.zeros((1, 128256), dtype=mx.float32))
    assert not argmax_cuda.supports(mx.zeros((3, 1, 10), dtype=mx.float16))
    assert not argmax_cuda.supports(mx.zeros((3, 10), dtype=mx.int32))
    assert not argmax_cuda.supports(mx.zeros((0, 10), dtype=mx.float16))


def test_off_where_mlx_has_no_cuda_and_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not argmax_cuda.enabled()  # this machine: MLX on the CPU
    monkeypatch.setattr(argmax_cuda, "_on_cuda", lambda: True)
    assert argmax_cuda.enabled()
    monkeypatch.setenv(argmax_cuda.ENV, "0")
    assert not argmax_cuda.enabled()


def test_greedy_steps_take_it_and_decode_the_same_tokens(demo_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step's wiring: with the kernel routed to the decode steps and on
    (``mx.argmax`` standing in for it: it cannot run here), every all-greedy decode step after a stream's first token hands
    its logits to it, and the streams' tokens are those of the steps without it; a
    step with a sampling stream in it does not (a greedy stream decoding before the
    other has joined may)."""
    from gmlx.engine import mlxlm, sampling
    from gmlx.engine.types import SamplingParams

    def decode(samplers: list) -> list[list[int]]:
        gen = mlxlm.batch_generator(demo_model.model, sorted(demo_model.tokenizer.eos_token_ids), width=4,
                                    prefill_step=64)
        params = [SamplingParams(logit_bias={e: -100.0 for e in demo_model.tokenizer.eos_token_ids})] * len(samplers)
        uids = gen.insert([[10 + i, 20, 30 + i] for i in range(len(samplers))], max_tokens=[8] * len(samplers),
                          samplers=samplers, logits_processors=[sampling.make_processors(p) for p in params])
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while any(len(tokens) < 8 for tokens in out.values()):
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
        gen.close()
        return [out[uid] for uid in uids]

    greedy = [sampling.greedy_sampler] * 3
    plain = decode(greedy)
    calls: list[tuple] = []

    def stand_in(logits: mx.array) -> mx.array:
        calls.append(logits.shape)
        return mx.argmax(logits, axis=-1)

    monkeypatch.setattr(argmax_cuda, "_on_cuda", lambda: True)
    monkeypatch.setattr(argmax_cuda, "argmax", stand_in)
    monkeypatch.setattr(mlxlm, "_greedy", list(mlxlm._greedy))  # (the route restored after the test)
    mlxlm.route_greedy(argmax_cuda.greedy)  # as a load on CUDA routes it once the kernel agreed
    monkeypatch.setattr(argmax_cuda, "_agrees", False)  # a check that failed: MLX's
    assert decode(greedy) == plain and not calls
    monkeypatch.setattr(argmax_cuda, "_agrees", True)
    assert decode(greedy) == plain
    assert len(calls) >= 7 and all(shape[0] <= 3 and shape[1] == demo_model.model.args.vocab_size for shape in calls)
    calls.clear()
    decode([sampling.greedy_sampler, sampling.make_sampler(SamplingParams(temperature=0.8, seed=1))])
    assert len(calls) < 7 and all(shape[0] == 1 for shape in calls)  # the greedy stream's steps alone, if any


@pytest.mark.parametrize("kernel,agrees", [("mx.argmax", True), ("off by one", False), ("does not compile", False)])
def test_a_load_checks_it_once_before_greedy_steps_take_it(monkeypatch: pytest.MonkeyPatch, kernel: str,
                                                          agrees: bool) -> None:
    """On CUDA (a stand-in for the kernel here: it cannot run) the first load's check runs
    it on each floating type against ``mx.argmax``; one that disagrees or fails (an NVRTC
    error is a RuntimeError) leaves greedy steps ``mx.argmax`` and the load goes on; the
    check is not run again in the process."""
    def stand_in(logits: mx.array) -> mx.array:
        seen.append(logits.dtype)
        if kernel == "does not compile":
            raise RuntimeError("nvrtc: error: identifier undefined\nmore")
        return mx.argmax(logits, axis=-1) + (1 if kernel == "off by one" else 0)

    seen: list = []
    monkeypatch.setattr(argmax_cuda, "_on_cuda", lambda: True)
    monkeypatch.setattr(argmax_cuda, "_agrees", None)
    monkeypatch.setattr(argmax_cuda, "argmax", stand_in)
    line = argmax_cuda.check()
    assert argmax_cuda._agrees is agrees
    assert line == ("cuda: a greedy step's argmax in one launch a row" if agrees else
                    "cuda: a greedy step's argmax stays MLX's: " + ("nvrtc: error: identifier undefined"
                                                                    if kernel == "does not compile" else
                                                                    "it disagrees with mx.argmax (mlx.core.float16, "
                                                                    "rows of 128256)"))
    assert set(seen) == ({mx.float16, mx.bfloat16, mx.float32} if agrees else {mx.float16})
    assert argmax_cuda.check() is None  # once a process
    logits = mx.array([[0.0, 3.0, 1.0]])
    seen.clear()
    assert argmax_cuda.greedy(logits).tolist() == [1 + (kernel == "off by one" and agrees)]
    assert bool(seen) is agrees


def test_a_load_routes_greedy_steps_to_it_only_where_it_agreed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare_layers`` (a model's load) routes the decode steps' argmax to the kernel
    where its check agreed; here (MLX on the CPU) it checks nothing and routes nothing."""
    from gmlx.engine import mlxlm
    from gmlx.engine.kernels import prepare_layers
    from tests.engine.kernels.models import tiny

    monkeypatch.setattr(mlxlm, "_greedy", list(mlxlm._greedy))
    before = mlxlm._greedy[0]
    monkeypatch.setattr(argmax_cuda, "_agrees", None)
    prepare_layers(tiny("llama", 2))
    assert mlxlm._greedy[0] is before and argmax_cuda._agrees is None
    monkeypatch.setattr(argmax_cuda, "_on_cuda", lambda: True)
    monkeypatch.setattr(argmax_cuda, "argmax", lambda logits: mx.argmax(logits, axis=-1))  # (a stand-in)
    monkeypatch.setattr(argmax_cuda, "_agrees", True)  # as after an earlier load's check
    prepare_layers(tiny("llama", 2))
    assert mlxlm._greedy[0] is argmax_cuda.greedy
