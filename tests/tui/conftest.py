"""Fixtures for the `gmlx top` tests: async tests run on asyncio (anyio's plugin)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
