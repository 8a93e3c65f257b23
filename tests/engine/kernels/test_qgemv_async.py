"""Where the one-row products stream their weights through shared memory (``GMLX_ASYNC=1``,
:mod:`qgemv_async`): the shapes the tuners time, the layouts and shapes refused, and the
shape a fused step kernel binds. Each streamed source itself runs on the CPU against MLX
in ``test_qgemv_cuda`` (plain, residual, gated, parts, the norm folded in), the copies
plain there; ``test_cuda_compile`` compiles them for sm_90 with the asynchronous copies."""

from __future__ import annotations

import mlx.core as mx
import pytest

from gmlx.engine.kernels import qgemv_async, qgemv_cuda


def test_streamed_shapes_only_where_asked_and_where_a_row_is_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(qgemv_async.ENV, raising=False)
    assert qgemv_async.shapes(14336) == [] and not any(len(c) > 6 for c in qgemv_cuda.configs(1, 14336))
    monkeypatch.setenv(qgemv_async.ENV, "1")
    assert qgemv_async.shapes(14336) == qgemv_async.ASYNC
    assert qgemv_async.shapes(512) == []  # less than one round of 32 chunks
    assert set(qgemv_async.ASYNC) <= set(qgemv_cuda.configs(1, 4096))
    gated = [c for c in qgemv_cuda.gated_configs(1, 4096) if len(c) > 6]
    assert gated and all(c[1] % 2 == 0 for c in gated)  # half gate, half up
    assert all(len(c) < 7 for c in qgemv_cuda.configs(4, 4096))  # one row only
    assert qgemv_cuda.launch_shape((4, 2, 1, 1, 0, 1, 4))[6] == 4
    assert qgemv_cuda.unstaged((4, 2, 1, 1, 0, 1, 4)) == (4, 2, 1, 1, 0, 1, 4)  # a fused kernel binds it as timed


def test_every_streamed_shape_fits_a_block_for_every_layout() -> None:
    """Each shape's shared memory (codes, scales and biases of every row-round) fits 48 KB
    at every width and group the kernel reads, 8-bit groups of 32 the largest."""
    for warps, rpw, *_, rounds in qgemv_async.ASYNC:
        for bits in qgemv_cuda.BITS:
            for group in qgemv_cuda.GROUPS:
                assert qgemv_async.shared_bytes(warps, rpw, rounds, bits, group) <= qgemv_async.SHARED_BYTES
    assert qgemv_async.shared_bytes(4, 4, 4, 8, 32) > qgemv_async.SHARED_BYTES  # what the list keeps out


def test_layouts_and_shapes_the_streamed_source_refuses() -> None:
    """A row whose scales do not start on 16 bytes (groups a row not a multiple of 8), and
    streaming beside a second row of x, x staged, K split or a deeper register form."""
    assert qgemv_async.fits(4096, 32) and qgemv_async.fits(14336, 128)
    assert not qgemv_async.fits(1088, 32)  # 34 groups a row
    with pytest.raises(ValueError, match="not streamed"):
        qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=1088, rounds=4)
    for kind in ({"max_rows": 2}, {"tiles": 1}, {"split": 2}, {"depth": 2}):
        with pytest.raises(ValueError, match="streamed source"):
            qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=4096, rounds=4, **kind)


def test_a_refused_layout_is_no_path_to_the_products_tuner() -> None:
    """The product tuner times every shape of ``configs`` on every layout; one the
    streamed source refuses (34 groups a row) is a path that does not run, not an error
    that stops the load."""
    from gmlx.engine.kernels import timing

    def streamed() -> None:
        qgemv_cuda.kernel_of(mx.float16, 4, 32, qgemv_async.ASYNC[0], k=1088)

    want = mx.zeros((1, 8), mx.float16)
    assert timing.runs_and_agrees(streamed, want, want) is False
