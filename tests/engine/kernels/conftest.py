"""The kernel sources' tests build each source as asked: the float sums unless a test
turns on x rounded to bytes (``GMLX_Q8X``, on by default where the products run on CUDA;
``test_qgemv_q8`` covers it, and that it is the default)."""

from __future__ import annotations

import pytest

from gmlx.engine.kernels import qgemv_q8


@pytest.fixture(autouse=True)
def _float_sums_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(qgemv_q8.ENV, "0")
