"""The kernel sources' tests build each source as asked: the float sums, one chunk a lane
in flight and K whole unless a test turns on x rounded to bytes (``GMLX_Q8X``), more
chunks a lane (``GMLX_Q8_DEPTH``) or K split between warps (``GMLX_SPLIT_K``), all three
on by default where the products run on CUDA (``test_qgemv_q8`` and ``test_qgemv_cuda``
cover them, and that they are the defaults), and each source inline where MLX is given
it through an ``#include`` of its file by default (``test_kernel_include`` covers that
form: the file holds the same text, and a real kernel's emulation runs it)."""

from __future__ import annotations

import pytest

from gmlx.engine.kernels import cuda_source, qgemv_q8, qgemv_split


@pytest.fixture(autouse=True)
def _float_sums_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(qgemv_q8.ENV, "0")
    monkeypatch.setenv(qgemv_q8.DEEP_ENV, "0")
    monkeypatch.setenv(qgemv_split.ENV, "0")
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "0")
