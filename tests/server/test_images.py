"""Images through the official SDKs: each protocol's image part is read and checked,
then refused with a 400 naming the part (no served model takes images yet), in the
protocol's own error shape; with mlx-vlm missing the message names the vision extra."""

from __future__ import annotations

import base64
import importlib.util
import io
from collections.abc import Callable

import anthropic
import openai
import pytest

EXTRA = "pip install 'gmlx[vision]'"


def png_b64(color: str = "green") -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


DATA_URI = f"data:image/png;base64,{png_b64()}"


@pytest.fixture(params=[True, False], ids=["vlm-installed", "vlm-missing"])
def vlm_installed(request, monkeypatch) -> bool:
    """Simulate mlx-vlm present or absent (the server runs in this process)."""
    real: Callable = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        if name == "mlx_vlm":
            return real("json") if request.param else None  # any spec stands for "found"
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return request.param


def assert_refusal(message: str, where: str, vlm_installed: bool) -> None:
    assert message.startswith(f"{where}: ") and "text-only" in message
    assert (EXTRA in message) is not vlm_installed


def chat_image(openai_client, url: str, **kwargs):
    return openai_client.chat.completions.create(
        model="demo",
        max_tokens=3,
        messages=[
            {"role": "system", "content": "Describe images."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ]},
        ],
        **kwargs,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_image_url_is_refused_as_text_only(openai_client, vlm_installed, stream) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat_image(openai_client, DATA_URI, stream=stream)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "messages[1].content[1]"
    assert_refusal(body["message"], "messages[1].content[1]", vlm_installed)


def test_chat_bad_base64_is_a_400_naming_the_part(openai_client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat_image(openai_client, "data:image/png;base64,@@not base64@@")
    message = err.value.body["message"]
    assert message.startswith("messages[1].content[1]: ") and "base64" in message


def test_chat_url_to_the_servers_own_routes_is_refused(openai_client, server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat_image(openai_client, f"{server.url}/v1/status")
    assert "loopback" in err.value.body["message"]


def test_anthropic_image_block_is_refused_in_anthropic_shape(anthropic_client, vlm_installed) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client.messages.create(
            model="demo",
            max_tokens=3,
            system="Describe images.",  # not a message here: the image is messages[0]
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png_b64()}},
                {"type": "text", "text": "What is this?"},
            ]}],
        )
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "text-only" in body["error"]["message"]
    assert (EXTRA in body["error"]["message"]) is not vlm_installed


def test_anthropic_count_tokens_refuses_an_image(anthropic_client) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client.messages.count_tokens(
            model="demo",
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "%%%"}},
            ]}],
        )
    assert "base64" in err.value.body["error"]["message"]


def test_responses_input_image_is_refused(openai_client, vlm_installed) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(
            model="demo",
            max_output_tokens=16,
            input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": DATA_URI, "detail": "auto"},
            ]}],
        )
    message = err.value.body["message"]
    assert "content[1]: " in message and "text-only" in message
    assert (EXTRA in message) is not vlm_installed


def test_estimate_refuses_an_image(http) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URI}}]}]}
    r = http.post("/v1/estimate", json=body)
    assert r.status_code == 400 and "messages[0].content[0]: " in r.json()["error"]["message"]
