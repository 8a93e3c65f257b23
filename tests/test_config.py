"""The config file: sections, validation messages, environment overrides, CLI models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gmlx.config import load_settings
from gmlx.engine.errors import ConfigError, ModelSourceError

GOOD = """\
server: {port: 9001, api_key: k, cors: true, decode_batch: 2}
models:
  demo: {source: demo, profile: coding, default: true, pinned: true}
  other: demo
aliases:
  coder: demo@mine
profiles:
  mine: {temperature: 0.1, max_tokens: 64, system: Be brief., stop: ["END"]}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gmlx.yaml"
    path.write_text(text)
    return path


def test_missing_default_file_is_an_empty_config():
    settings = load_settings()
    assert settings.models == {} and settings.server.port == 8080
    assert "not found" in settings.origin


def test_missing_explicit_file_fails(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")


def test_a_full_file(tmp_path):
    path = write(tmp_path, GOOD)
    s = load_settings(path)
    assert s.origin == str(path)
    assert (s.server.port, s.server.api_key, s.server.cors, s.server.decode_batch) == (
        9001,
        "k",
        ["*"],
        2,
    )
    assert s.models["other"].source == "demo" and s.models["demo"].pinned
    assert s.startup_models() == ["demo"]
    registry = s.registry()
    assert registry.address("coder").profile == "mine"
    assert registry.address("").spec.id == "demo"
    mine = s.profile_book().user["mine"]
    assert mine.sampling == {"temperature": 0.1} and mine.stop == ("END",) and mine.max_tokens == 64


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        (
            "models:\n  demo: {source: demo, max_kv_size: lots}\n",
            "models.demo.max_kv_size",
            "integer",
        ),
        ("models:\n  demo: {source: demo, colour: red}\n", "models.demo.colour", "unknown key"),
        ("modles: {}\n", "modles", "unknown key"),
        ("server: {port: 99999}\n", "server.port", "65535"),
        ("server: {prot: 1}\n", "server.prot", "unknown key"),
        ("profiles:\n  p: {temperature: -1}\n", "profiles.p.temperature", "0"),
        (
            "models:\n  demo: {source: demo, profile: nope}\n",
            "models.demo.profile",
            "unknown profile 'nope'",
        ),
        ("models: {demo: demo}\naliases: {c: missing@coding}\n", "aliases.c", "does not name"),
        ("models: {demo: demo}\naliases: {c: demo@nope}\n", "aliases.c", "unknown profile"),
        ("models: {demo: demo}\naliases: {demo: demo@coding}\n", "aliases.demo", "cannot reuse"),
        (
            "models:\n  a: {source: demo, default: true}\n  b: {source: demo, default: true}\n",
            "models.b.default",
            "only one",
        ),
    ],
)
def test_bad_values_name_file_key_and_reason(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    message = str(err.value)
    assert str(path) in message and key in message and reason in message, message


def test_bad_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "models:\n  demo: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d"):
        load_settings(path)


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, "server: {port: 9001, sse_keepalive_s: 5}\n")
    monkeypatch.setenv("GMLX_PORT", "9100")
    monkeypatch.setenv("GMLX_SSE_KEEPALIVE_S", "2.5")
    monkeypatch.setenv("GMLX_CORS", "http://a.test, http://b.test")
    s = load_settings(path)
    assert (s.server.port, s.server.sse_keepalive_s) == (9100, 2.5)
    assert s.server.cors == ["http://a.test", "http://b.test"]
    monkeypatch.setenv("GMLX_PORT", "eighty")
    with pytest.raises(ConfigError, match=r"server\.port \(set by GMLX_PORT\)"):
        load_settings(path)


def test_command_line_models(tmp_path):
    s = load_settings(write(tmp_path, GOOD))
    s2, names = s.with_models(["demo@coding", "coder", "other"])
    assert names == ["demo@coding", "coder", "other"]
    assert s2.startup_models() == ["demo", "other"]
    empty, names = load_settings().with_models(["demo@creative"])
    assert names == ["demo@creative"] and list(empty.models) == ["demo"]
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_settings().with_models([str(tmp_path / "missing.gguf")])


def test_serve_fails_on_a_bad_config_with_one_sentence(tmp_path):
    path = write(tmp_path, "server: {port: high}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gmlx.cli.main", "serve", "demo", "--config", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert str(path) in lines[0] and "server.port" in lines[0]


def test_command_line_hf_models(hf_cache, demo_files):
    hf_cache("gmlx-test/demo-mlx", demo_files)
    s, names = load_settings().with_models(["hf:gmlx-test/demo-mlx@coding"])
    assert names == ["demo-mlx@coding"]
    assert s.models["demo-mlx"].source == "hf:gmlx-test/demo-mlx"
    with pytest.raises(ModelSourceError, match="never downloads"):
        load_settings().with_models(["hf:gmlx-test/absent"])
