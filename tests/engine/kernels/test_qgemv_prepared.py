"""Where the normed one-row products make x once a block (``GMLX_PREPARED=1``,
:mod:`qgemv_prepared`): which products and shapes take the prepared source, the ones it
refuses, and its shared memory. The source itself runs on the CPU against MLX's norm and
products in ``test_qgemv_cuda`` (gated, parts, plain; 4, 6 and 8 bits) and compiles for
sm_90 in ``test_cuda_compile``."""

from __future__ import annotations

import mlx.core as mx
import pytest

from gmlx.engine.kernels import qgemv_async, qgemv_cuda, qgemv_prepared


def _made(monkeypatch: pytest.MonkeyPatch, config: tuple[int, ...], **kw) -> dict:
    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **k: made.append(k) or k)
    qgemv_cuda._kernel.cache_clear()
    try:
        qgemv_cuda.kernel_of(mx.float16, 4, 32, config, **kw)
    finally:
        qgemv_cuda._kernel.cache_clear()
    return made[0]


def test_only_normed_one_row_products_take_it_and_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(qgemv_prepared.ENV, raising=False)
    assert "_p_" not in _made(monkeypatch, (4, 4, 1), gated=True, k=4096, eps=1e-5)["name"]
    monkeypatch.setenv(qgemv_prepared.ENV, "1")
    made = _made(monkeypatch, (4, 4, 1), gated=True, k=4096, eps=1e-5)
    assert "_p_" in made["name"] and "XCHUNKS = 128;" in made["source"] and "xsh[8][XCHUNKS]" in made["source"]
    # the q-k-v and plain normed products only under "all" (prepared, the q-k-v's best shapes measured slower)
    assert "_p_" not in _made(monkeypatch, (8, 1), parts=(4096, 1024, 1024), k=4096, eps=1e-5)["name"]
    assert "_p_" not in _made(monkeypatch, (4, 2), k=4096, eps=1e-5)["name"]
    monkeypatch.setenv(qgemv_prepared.ENV, "all")
    assert "_p_" in _made(monkeypatch, (8, 1), parts=(4096, 1024, 1024), k=4096, eps=1e-5)["name"]
    assert "_p_" in _made(monkeypatch, (4, 2), k=4096, eps=1e-5)["name"]
    assert "_p_" not in _made(monkeypatch, (4, 4), k=4096)["name"]  # no norm: x is the input as it is
    assert "_p_" not in _made(monkeypatch, (4, 2, 1, 2), gated=True, k=4096, eps=1e-5)["name"]  # depth 2
    assert "_p_" not in _made(monkeypatch, qgemv_async.ASYNC[0], gated=True, k=4096, eps=1e-5)["name"]  # streamed
    assert "_p_" not in _made(monkeypatch, (4, 4, 1), gated=True, k=16384, eps=1e-5)["name"]  # x's floats: 64 KB
    assert "_p_" not in _made(monkeypatch, (4, 4, 1), gated=True, eps=1e-5)["name"]  # no width given


def test_shapes_and_widths_the_prepared_source_refuses() -> None:
    for kind in ({"max_rows": 2}, {"tiles": 1}, {"split": 2}, {"depth": 2}, {"rounds": 4}):
        with pytest.raises(ValueError, match="prepared once a block"):
            qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=4096, eps=1e-5, prepared=True, **kind)
    with pytest.raises(ValueError, match="prepared once a block"):
        qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=4096, prepared=True)  # no norm
    with pytest.raises(ValueError, match="not prepared"):
        qgemv_cuda._kernel(mx.float16, 4, 32, 4, 2, k=12288, eps=1e-5, prepared=True)


def test_shared_memory_of_a_row() -> None:
    """x's floats, a sum a chunk and a float a warp: an 8B's 4,096 values take 16.5 KB, a
    70B's 8,192 fit, 12,288 do not."""
    assert qgemv_prepared.shared_bytes(4096, 4) == 4 * 4096 + 4 * 128 + 16
    assert qgemv_prepared.fits(8192, 8) and not qgemv_prepared.fits(12288, 4)
