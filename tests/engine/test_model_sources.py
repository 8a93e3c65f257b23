"""Model sources: the demo model's build and reuse, MLX folders, and bad paths."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.loading import demo, load_model, load_tokenizer, source_kind


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_demo_is_built_into_gmlx_home_and_reused(demo_model, gmlx_home):
    folder = demo.demo_dir()
    assert folder.is_relative_to(gmlx_home)
    assert demo_model.kind == "demo" and demo_model.id == "demo"
    before = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    again = load_model("demo")
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # not rebuilt
    assert again.config == demo_model.config


def test_demo_shape_and_template(demo_model):
    cfg = demo_model.config
    assert cfg["hidden_size"] <= 256 and cfg["num_hidden_layers"] <= 4
    tok = demo_model.tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert "<tools>" in text and "get_weather" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_demo_build_is_deterministic(tmp_path, monkeypatch, demo_model):
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    rebuilt = demo.ensure_built()
    assert rebuilt.is_relative_to(tmp_path)
    assert digest(rebuilt) == digest(demo_model.source)


def test_interrupted_demo_build_is_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("GMLX_HOME", str(tmp_path))
    broken = demo.demo_dir()
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{")
    assert load_model("demo").config["model_type"] == "qwen2"


def test_cache_dir_honours_xdg(tmp_path, monkeypatch):
    from gmlx.paths import cache_dir

    monkeypatch.delenv("GMLX_HOME", raising=False)
    monkeypatch.delenv("GMLX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "gmlx"
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_mlx_folder_loads_through_mlx_lm(demo_model, tmp_path):
    folder = tmp_path / "my-model"
    shutil.copytree(demo_model.source, folder)
    loaded = load_model(folder)
    assert loaded.kind == "mlx" and loaded.id == "my-model"
    assert loaded.context_length == demo_model.config["max_position_embeddings"]
    assert loaded.tokenizer.chat_template == demo_model.tokenizer.chat_template
    assert load_tokenizer(folder).encode("hello world") == demo_model.tokenizer.encode("hello world")


@pytest.fixture
def model_copy(demo_model, tmp_path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(demo_model.source, folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda d: d / "missing", ModelSourceError, "does not exist"),
        (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", ModelSourceError, "is not a model"),
        (lambda d: (d / "empty").mkdir() or d / "empty", ModelSourceError, "no config.json"),
    ],
)
def test_bad_paths_name_the_path_and_reason(tmp_path, make, error, words):
    path = make(tmp_path)
    with pytest.raises(error) as info:
        load_model(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, model_type="quantum_llm")
    with pytest.raises(UnsupportedModelError) as info:
        load_model(model_copy)
    msg = str(info.value)
    assert "quantum_llm" in msg and str(model_copy) in msg and "llama" in msg


def test_config_without_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["model_type"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="model_type"):
        load_model(model_copy)


def test_broken_config_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json"):
        load_model(model_copy)


def test_missing_weights(model_copy):
    os.remove(model_copy / "model.safetensors")
    with pytest.raises(ModelSourceError, match="safetensors"):
        load_model(model_copy)


def test_weights_that_do_not_match_the_config(model_copy):
    edit_config(model_copy, hidden_size=64)
    with pytest.raises(ModelSourceError) as info:
        load_model(model_copy)
    assert str(model_copy) in str(info.value)


def test_missing_tokenizer(model_copy):
    os.remove(model_copy / "tokenizer.json")
    with pytest.raises(ModelSourceError, match="tokenizer"):
        load_model(model_copy)


def test_source_kind(tmp_path, demo_model):
    assert source_kind("demo") == "demo"
    assert source_kind(demo_model.source) == "mlx"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    assert source_kind(gguf) == "gguf"
    assert source_kind(tmp_path) == "gguf"  # a folder holding exactly one GGUF file
