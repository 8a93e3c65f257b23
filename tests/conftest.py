"""Shared fixtures: an isolated gmlx home and the demo model, built once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
VOCAB_DIR = SHARED / "fixtures" / "vocab"
VOCABS = ["qwen2", "llama-bpe", "llama-spm", "phi-3", "gemma-4"]  # the vocab fixtures there


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


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A private, offline Hugging Face hub cache; returns ``cache(repo_id, files)`` that
    stores ``{path in repo: local file}`` as ``hf download`` would (blobs, snapshot
    symlinks, ``refs/main``) and returns the snapshot folder."""
    import hashlib
    import shutil

    root = tmp_path / "hf-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HOME", raising=False)

    def cache(repo_id: str, files: dict[str, Path]) -> Path:
        repo = root / f"models--{repo_id.replace('/', '--')}"
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        for name, source in files.items():
            digest = hashlib.sha256(source.read_bytes()).hexdigest()
            blob = repo / "blobs" / digest
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, blob)
            link = snapshot / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        return snapshot

    cache.root = root  # type: ignore[attr-defined]
    return cache


@pytest.fixture(scope="session")
def demo_files(gmlx_home: Path) -> dict[str, Path]:
    """The demo model's files by name, as a repo would hold them."""
    from gmlx.engine.loading import demo

    folder = demo.ensure_built()
    return {p.name: p for p in folder.iterdir() if p.is_file()}
