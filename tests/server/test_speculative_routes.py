"""Speculative models on a live server: the listing's marker, the metrics row's
``speculative`` object, greedy answers equal to the undrafted model's, the typed 400
for a structured request, and config errors for a bad drafter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_server import LiveServer

from gmlx.compose import build_app
from gmlx.config import load_settings
from gmlx.engine.errors import ConfigError

CONFIG = """\
server:
  decode_batch: 4
  warmup: false
models:
  plain:
    source: demo
  drafted:
    source: demo
    draft_model: plain
    draft_tokens: 3
  lookup:
    source: demo
    prompt_lookup: true
"""


@pytest.fixture(scope="module")
def live(gmlx_home: Path) -> Iterator[LiveServer]:
    path = gmlx_home / "speculative.yaml"
    path.write_text(CONFIG)
    server = LiveServer.start(build_app(load_settings(path)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def ask(client: openai.OpenAI, model: str, content: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=kw.pop("max_tokens", 40), **kw)


def test_listing_marks_speculative_models(client):
    marks = {m.id: m.model_extra["speculative"] for m in client.models.list().data}
    assert marks["drafted"] is True and marks["lookup"] is True and marks["plain"] is False


@pytest.mark.parametrize("model", ["drafted", "lookup"])
def test_greedy_answers_equal_the_plain_model(client, model):
    for content in ("Write a haiku about the sea.", "def add(a, b):\n    return a + b\ndef add(a, b):"):
        want = ask(client, "plain", content)
        got = ask(client, model, content)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens


def test_metrics_row_carries_the_drafting_counts(client, live):
    import httpx

    stream = ask(client, "drafted", "Count forever.", max_tokens=4000, stream=True)
    try:
        chunks = iter(stream)
        for _ in range(30):
            next(chunks)
        rows = httpx.get(f"{live.url}/v1/metrics", timeout=10).json()["server"]["requests"]
        (row,) = [r for r in rows if r["model"] == "drafted"]
    finally:
        stream.close()
    spec = row["speculative"]
    assert set(spec) == {"rounds", "drafted", "accepted", "accept_rate"}
    assert spec["rounds"] >= 1 and spec["drafted"] >= spec["accepted"] >= 1
    assert spec["accept_rate"] == 1.0  # the same weights draft: every draft is the target's


def test_structured_request_is_a_typed_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "drafted", "A JSON object.", response_format={"type": "json_object"})
    error = e.value.body
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == "response_format" and "speculative" in error["message"]


@pytest.mark.parametrize(("entry", "reason"), [
    ("draft_model: nowhere/at/all", "neither a configured model nor a model path"),
    ("draft_model: demo\n    prompt_lookup: true", "exclude each other"),
    ("prompt_lookup: true\n    draft_tokens: 0", "draft_tokens"),
])
def test_config_errors_name_the_key(gmlx_home, entry, reason):
    path = gmlx_home / "bad-speculative.yaml"
    path.write_text(f"models:\n  m:\n    source: demo\n    {entry}\n")
    with pytest.raises(ConfigError, match=reason):
        load_settings(path)


def test_draft_model_with_another_tokenizer_fails_the_load(gmlx_home):
    from gmlx.compose import build_registry
    from gmlx.engine.errors import ModelSourceError

    path = gmlx_home / "vocab-speculative.yaml"
    path.write_text("server:\n  warmup: false\nmodels:\n  m:\n    source: demo\n    draft_model: demo-vision\n")
    registry = build_registry(load_settings(path))
    try:
        with pytest.raises(ModelSourceError, match="tokenizer"):
            registry.worker("m")
    finally:
        registry.close()


def test_a_draft_model_is_priced_with_its_target(client):
    """A drafter's weights and KV cache are memory its model holds: the listing's
    ``kv_bytes_per_token`` counts both caches (the demo drafting for itself: twice the
    plain model's), while prompt lookup costs nothing."""
    for m in client.models.list().data:  # resident: only a loaded model has measured bytes
        client.chat.completions.create(model=m.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    listed = {m.id: m.model_extra for m in client.models.list().data}
    plain = listed["plain"]["kv_bytes_per_token"]
    assert plain > 0
    assert listed["drafted"]["kv_bytes_per_token"] == 2 * plain
    assert listed["lookup"]["kv_bytes_per_token"] == plain


def _gmlx(*args: str):
    from typer.testing import CliRunner

    from gmlx.cli.main import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("drafting", [("--draft", "demo"), ("--prompt-lookup",)], ids=["draft", "lookup"])
def test_run_with_a_drafter_answers_as_without(drafting):
    plain = _gmlx("run", "demo", "-p", "hello there hello there", "-n", "16", "-t", "0")
    drafted = _gmlx("run", "demo", "-p", "hello there hello there", "-n", "16", "-t", "0", *drafting,
                    "--draft-tokens", "3")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert drafted.stdout == plain.stdout and plain.stdout.strip()


def test_run_with_a_missing_draft_model_fails_in_one_sentence(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "nowhere.gguf"
    r = subprocess.run([sys.executable, "-m", "gmlx.cli.main", "run", "demo", "-p", "hi", "--draft", str(missing)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == f"error: The draft model '{missing}' is neither a configured model nor a model path."
