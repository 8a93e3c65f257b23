"""Shared fixtures: an isolated gmlx home and the demo model, built once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
VOCAB_DIR = SHARED / "fixtures" / "vocab"


@pytest.fixture(scope="session", autouse=True)
def gmlx_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test runs against a private GMLX_HOME, never the user's cache."""
    home = tmp_path_factory.mktemp("gmlx-home")
    old = os.environ.get("GMLX_HOME")
    os.environ["GMLX_HOME"] = str(home)
    os.environ.pop("GMLX_CACHE_DIR", None)
    yield home
    if old is None:
        os.environ.pop("GMLX_HOME", None)
    else:
        os.environ["GMLX_HOME"] = old


@pytest.fixture(scope="session")
def demo_model(gmlx_home: Path):
    from gmlx.engine.loading import load_model

    return load_model("demo")


@pytest.fixture(scope="session")
def demo_worker(demo_model):
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=4)
    yield worker
    worker.close()


def vocab_path(name: str) -> Path:
    """A llama.cpp vocab GGUF from ../shared/fixtures/vocab, or skip with the reason."""
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"vocab fixture {path} is absent (CI keeps ../shared beside the checkout)")
    return path
