"""The config file: sections, validation messages, environment overrides, CLI models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gmlx.compose import build_registry
from gmlx.config import ProfileConfig, load_settings
from gmlx.engine.errors import ConfigError, ModelNotFoundError, ModelSourceError
from gmlx.engine.types import SamplingParams
from gmlx.sampling_fields import SAMPLING_FIELDS
from gmlx.server.schemas import GenerationBody

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
    registry = build_registry(s)
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
        # The engine's own rules, as for a request's values:
        ("profiles:\n  p: {typical_p: 0}\n", "profiles.p.typical_p", "must be in (0, 1]"),
        ("profiles:\n  p: {xtc_threshold: 2}\n", "profiles.p.xtc_threshold", "[0, 1]"),
        ("profiles:\n  p: {top_n_sigma: -1}\n", "profiles.p.top_n_sigma", ">= 0"),
        ("profiles:\n  p: {presence_penalty: 3}\n", "profiles.p.presence_penalty", "[-2, 2]"),
        ("profiles:\n  p: {repetition_context_size: 0}\n", "profiles.p.repetition_context_size",
         ">= 1"),
        ("profiles:\n  p: {logit_bias: {5: 500}}\n", "profiles.p.logit_bias", "[-100, 100]"),
        ("profiles:\n  p: {logit_bias: {x: 1}}\n", "profiles.p.logit_bias", "token ids"),
        ("profiles:\n  p: {top_k: lots}\n", "profiles.p.top_k", "integer"),
        ("profiles:\n  p: {p_less: maybe}\n", "profiles.p.p_less", "boolean"),
        ("profiles:\n  p: {temprature: 1}\n", "profiles.p.temprature", "unknown key"),
        ("server: {top_logprobs_k: 21}\n", "server.top_logprobs_k", "20"),
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


@pytest.mark.parametrize("configured", [True, False])
def test_a_command_line_suffix_that_is_no_profile_is_part_of_the_ref(tmp_path, configured):
    settings = load_settings(write(tmp_path, GOOD)) if configured else load_settings()
    with pytest.raises(ModelNotFoundError) as err:
        settings.with_models(["demo@nope"])
    message = str(err.value)
    assert "'demo@nope'" in message and "coding" in message  # the whole ref, the valid profiles


def test_a_configured_id_with_an_at_stays_whole(tmp_path):
    s = load_settings(write(tmp_path, "models:\n  team@v2: demo\n  team: demo\n"))
    s2, names = s.with_models(["team@v2", "team@v2@coding"])
    assert names == ["team@v2", "team@v2@coding"] and s2.startup_models() == ["team@v2"]
    assert build_registry(s2).address("team@v2@coding").spec.id == "team@v2"


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


# -- one definition of the sampling fields ----------------------------------------------

WIDE = """\
models: {demo: demo}
profiles:
  wide:
    temperature: 0.8
    top_p: 0.9
    top_k: 40
    min_p: 0.02
    top_n_sigma: 1.5
    typical_p: 0.95
    xtc_probability: 0.5
    xtc_threshold: 0.2
    p_less: true
    logit_bias: {5: -100, "7": 2.5}
    repetition_penalty: 1.1
    repetition_context_size: 64
    presence_penalty: 0.3
    presence_context_size: 32
    frequency_penalty: -0.2
    frequency_context_size: 16
    seed: 7
    max_tokens: 100
"""


def test_every_sampling_field_is_a_profile_key_and_a_request_field():
    engine = set(SamplingParams.__dataclass_fields__)
    assert set(SAMPLING_FIELDS) == engine
    assert engine <= set(ProfileConfig.model_fields) and engine <= set(GenerationBody.model_fields)


def test_a_yaml_profile_reaches_the_engines_sampling_params(tmp_path):
    s = load_settings(write(tmp_path, WIDE))
    registry = build_registry(s)
    target = registry.address("demo@wide")
    params = registry.profiles.resolve(target.profile_name, "llama").sampling_params()
    assert params == SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        min_p=0.02,
        top_n_sigma=1.5,
        typical_p=0.95,
        xtc_probability=0.5,
        xtc_threshold=0.2,
        p_less=True,
        logit_bias={5: -100.0, 7: 2.5},
        repetition_penalty=1.1,
        repetition_context_size=64,
        presence_penalty=0.3,
        presence_context_size=32,
        frequency_penalty=-0.2,
        frequency_context_size=16,
        seed=7,
    )
    # A request's explicit values still win over the profile's.
    assert registry.profiles.resolve("wide", "llama").sampling_params({"top_k": 3}).top_k == 3


def test_request_bodies_take_the_same_fields_strictly():
    body = GenerationBody.model_validate_json(
        '{"model": "demo", "top_n_sigma": 1, "p_less": true, "logit_bias": {"5": -100}}'
    )
    assert (body.top_n_sigma, body.p_less, body.logit_bias) == (1.0, True, {5: -100.0})
    with pytest.raises(ValueError, match="top_k"):
        GenerationBody.model_validate_json('{"top_k": "3"}')  # a string is not a number here


# -- TOP_LOGPROBS_K -------------------------------------------------------------------


def test_top_logprobs_k_from_env_and_file(tmp_path, monkeypatch):
    assert load_settings().server.top_logprobs_k == 0
    path = write(tmp_path, "server: {top_logprobs_k: 3}\n")
    assert load_settings(path).server.top_logprobs_k == 3
    monkeypatch.setenv("GMLX_TOP_LOGPROBS_K", "4")
    assert load_settings(path).server.top_logprobs_k == 4
    monkeypatch.setenv("TOP_LOGPROBS_K", "5")  # the spec's name wins
    assert load_settings(path).server.top_logprobs_k == 5


@pytest.mark.parametrize("value", ["21", "-1", "many"])
def test_a_bad_top_logprobs_k_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("TOP_LOGPROBS_K", value)
    with pytest.raises(ConfigError, match=r"server\.top_logprobs_k \(set by TOP_LOGPROBS_K\)"):
        load_settings()


def test_top_logprobs_k_caps_a_live_servers_alternatives(tmp_path, monkeypatch):
    import openai
    from live_server import serve_config

    monkeypatch.setenv("TOP_LOGPROBS_K", "2")  # read once, as the server starts
    live = serve_config(tmp_path, "server: {top_logprobs_k: 1}\n")
    monkeypatch.setenv("TOP_LOGPROBS_K", "7")  # too late: changes nothing
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
        )
    finally:
        live.stop()
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content)
