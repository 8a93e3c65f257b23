"""Faults under a running server: a resident model's weights file removed or truncated
(streams go on from memory; loading it again fails with a typed error naming it)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from live_server import serve_config


@pytest.fixture
def model_folder(tmp_path, demo_files):
    folder = tmp_path / "weights"
    folder.mkdir()
    for name, source in demo_files.items():
        shutil.copyfile(source, folder / name)
    return folder


def stream_chat(client: httpx.Client, url: str, no_eos: dict[str, int], max_tokens: int):
    return client.stream("POST", f"{url}/v1/chat/completions", json={
        "model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0, "logit_bias": no_eos,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Write a long story."}],
    })


@pytest.mark.parametrize("fault", ["removed", "truncated"])
def test_weights_lost_while_resident_serve_on_and_reload_fails_naming_the_file(tmp_path, model_folder, fault):
    weights = model_folder / "model.safetensors"
    live = serve_config(tmp_path, f"models:\n  m:\n    source: {model_folder}\n", models=("m",))
    try:
        worker = live.app.state.registry.workers()[0]
        no_eos = {str(t): -100 for t in worker.loaded.tokenizer.eos_token_ids}
        with httpx.Client(timeout=120) as client:
            with stream_chat(client, live.url, no_eos, 200) as response:
                lines = response.iter_lines()
                assert any('"content":' in line for line in lines)  # decoding: now the fault
                if fault == "removed":
                    weights.unlink()
                else:
                    with weights.open("r+b") as f:
                        f.truncate(weights.stat().st_size // 2)
                chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert chunks[-1]["usage"]["completion_tokens"] == 200
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            after = client.post(f"{live.url}/v1/chat/completions", json={
                "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            assert after.status_code == 200, after.text  # still served from memory
            unload = client.post(f"{live.url}/unload", json={"model": "m"})
            assert unload.json()["unloaded"] == ["m"]
            again = client.post(f"{live.url}/v1/chat/completions", json={
                "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert again.status_code == 503
        error = again.json()["error"]
        assert error["type"] == "model_load_error" and error["code"] == "model_load_error"
        assert str(model_folder) in error["message"]
        assert ("model.safetensors" if fault == "truncated" else "no .safetensors weights") in error["message"]
    finally:
        live.stop()
