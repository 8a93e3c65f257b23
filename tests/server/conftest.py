"""Real servers for the server tests: uvicorn on 127.0.0.1, a free port, a thread each.

``server`` serves a config with the demo model (the default, profile ``chat``),
``tiny`` (the demo model with a 64-token window), an alias and a user profile.
``key_server`` serves the demo model behind an API key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import LiveServer

from gmlx.compose import build_app
from gmlx.config import load_settings

API_KEY = "sk-test-gmlx"

CONFIG = """\
server:
  decode_batch: 4
models:
  demo:
    source: demo
    profile: chat
    default: true
  tiny:
    source: demo
    max_kv_size: 64
aliases:
  coder: demo@qwen-coder
profiles:
  qwen-coder:
    temperature: 0.0
    max_tokens: 5
    system: You write short, correct code and nothing else.
"""


@pytest.fixture(scope="session")
def config_path(gmlx_home: Path) -> Path:
    path = gmlx_home / "server-test.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="session")
def server(config_path: Path) -> Iterator[LiveServer]:
    settings, _ = load_settings(config_path).with_models(["demo"])
    live = LiveServer.start(build_app(settings))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def key_server(gmlx_home: Path) -> Iterator[LiveServer]:
    settings, _ = load_settings().with_models(["demo"])  # no file: empty config
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"api_key": API_KEY})}
    )
    live = LiveServer.start(build_app(settings))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def base_url(server: LiveServer) -> str:
    return f"{server.url}/v1"


@pytest.fixture(scope="session")
def openai_client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=30, max_retries=0)


@pytest.fixture(scope="session")
def anthropic_client(server: LiveServer):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=30, max_retries=0)


@pytest.fixture(scope="session")
def http(server: LiveServer) -> Iterator:
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def demo_tokenizer(gmlx_home: Path):
    from gmlx import load_tokenizer

    return load_tokenizer("demo")
