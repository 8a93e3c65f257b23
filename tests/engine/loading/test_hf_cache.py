"""``hf:`` references: resolved from the local Hugging Face cache, never the network."""

from __future__ import annotations

import socket

import pytest

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.loading import load_model, load_tokenizer, source_kind
from gmlx.engine.loading.hf_cache import resolve


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test, whatever HF_HUB_OFFLINE says."""

    def refuse(*args, **kwargs):
        raise AssertionError("gmlx tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_mlx_repo_loads_from_the_cache(hf_cache, demo_files, no_network):
    snapshot = hf_cache("gmlx-test/demo-mlx", demo_files)
    ref = "hf:gmlx-test/demo-mlx"
    assert resolve(ref) == snapshot
    assert source_kind(ref) == "mlx"
    loaded = load_model(ref, model_id="qwen")
    assert (loaded.id, loaded.kind, loaded.source) == ("qwen", "mlx", snapshot)
    assert load_tokenizer(ref).encode("hello") == loaded.tokenizer.encode("hello")


def test_gguf_file_in_a_repo(hf_cache, tiny_models, no_network):
    model = tiny_models["qwen2-Q4_K"]
    snapshot = hf_cache("gmlx-test/tiny-GGUF", {"tiny-q4_k.gguf": model.path})
    ref = "hf:gmlx-test/tiny-GGUF/tiny-q4_k.gguf"
    assert resolve(ref) == snapshot / "tiny-q4_k.gguf"
    assert source_kind(ref) == "gguf"
    loaded = load_model(ref, model_id="tiny")
    assert loaded.kind == "gguf" and loaded.source.name == "tiny-q4_k.gguf"
    # A repo folder holding one GGUF file is that model, as a local folder is.
    assert source_kind("hf:gmlx-test/tiny-GGUF") == "gguf"


def test_a_file_cached_alone_resolves(hf_cache, tiny_models, no_network):
    """`hf download org/repo file.gguf` caches one file; the rest of the repo may be absent."""
    snapshot = hf_cache("gmlx-test/big-GGUF", {"q4/model.gguf": tiny_models["qwen2-Q4_K"].path})
    assert resolve("hf:gmlx-test/big-GGUF/q4/model.gguf") == snapshot / "q4" / "model.gguf"
    assert resolve("hf:gmlx-test/big-GGUF/q4") == snapshot / "q4"


@pytest.mark.parametrize(
    "ref", ["hf:gmlx-test/absent", "hf:gmlx-test/demo-mlx/absent.gguf", "hf:gmlx-test/demo-mlx/q8"]
)
def test_what_is_not_cached_is_never_downloaded(hf_cache, demo_files, no_network, ref):
    hf_cache("gmlx-test/demo-mlx", demo_files)
    with pytest.raises(ModelSourceError) as info:
        load_model(ref)
    message = str(info.value)
    assert ref in message and str(hf_cache.root) in message
    assert "never downloads" in message and info.value.status == 503


@pytest.mark.parametrize("ref", ["hf:", "hf:gpt2", "hf:org//x", "hf:org/re po", "hf:-org/repo"])
def test_malformed_refs(hf_cache, ref):
    with pytest.raises(ModelSourceError, match="hf:"):
        source_kind(ref)
