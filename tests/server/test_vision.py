"""Images on a vision model through the official SDKs, end to end on real MLX.

One module server serves the built-in ``demo-vision`` (a tiny random Gemma 3 vision
model: 64-pixel images, 16 image tokens each) beside the text-only ``demo``, with image
URLs fetched from loopback allowed (``server.image_fetch_private``) and a small
``server.image_max_bytes``; a stdlib HTTP server on 127.0.0.1 serves the image URLs.
Every generation is greedy, so an answer is a function of the prompt and its images:
two different images answer differently, one image sent twice (or once inline and once
by URL, streamed or not) answers the same.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer

from gmlx.compose import build_app
from gmlx.config import load_settings

IMAGE_TOKENS = 16  # demo-vision pools each image to 16 soft tokens
MAX_BYTES = 200_000  # the server's image cap here: BIG is past it
MAX_TOKENS = 8
QUESTION = "What is in this picture?"

CONFIG = f"""\
server:
  decode_batch: 4
  image_fetch_private: true
  image_max_bytes: {MAX_BYTES}
  image_fetch_timeout_s: 5
models:
  demo-vision:
    source: demo-vision
  demo:
    source: demo
"""

# The same models with the image settings left at their defaults (loopback refused).
DEFAULT_CONFIG = """\
models:
  demo-vision:
    source: demo-vision
"""


def png(seed: int, size: int = 64) -> bytes:
    """A PNG of seeded noise (noise, so images differ everywhere and do not compress)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


RED, BLUE = png(1), png(2)
BIG = png(3, size=400)  # ~480 KB, past MAX_BYTES
NOT_AN_IMAGE = b"%PDF-1.4 this is not an image at all\n"
assert len(BIG) > MAX_BYTES


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


# -- the image host -------------------------------------------------------------------

ROUTES: dict[str, tuple[str, bytes]] = {
    "/red.png": ("image/png", RED),
    "/blue.png": ("image/png", BLUE),
    "/big.png": ("image/png", BIG),
    "/fake.png": ("image/png", NOT_AN_IMAGE),
    "/page.html": ("text/html", b"<html>not an image</html>"),
}


class _ImageHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        route = ROUTES.get(self.path)
        if route is None:
            self.send_error(404)
            return
        kind, body = route
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images_url() -> Iterator[str]:
    """The base URL of a local HTTP server serving ``ROUTES`` (anything else: 404)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# -- the servers ----------------------------------------------------------------------


def _serve(folder: Path, yaml_text: str, models: list[str]) -> LiveServer:
    path = folder / "gmlx.yaml"
    path.write_text(yaml_text)
    settings, _ = load_settings(path).with_models(models)
    return LiveServer.start(build_app(settings))


@pytest.fixture(scope="module")
def vserver(tmp_path_factory: pytest.TempPathFactory, gmlx_home: Path) -> Iterator[LiveServer]:
    """demo-vision and demo, both loaded at start."""
    live = _serve(tmp_path_factory.mktemp("vision"), CONFIG, ["demo-vision", "demo"])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory, gmlx_home: Path) -> Iterator[LiveServer]:
    """demo-vision under the default image settings, not loaded (images are checked first)."""
    live = _serve(tmp_path_factory.mktemp("vision-default"), DEFAULT_CONFIG, [])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def oai(vserver: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vserver.url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def ant(vserver: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=vserver.url, api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def http(vserver: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vserver.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def no_eos(gmlx_home: Path) -> dict[str, float]:
    """A logit bias that keeps the random model from stopping early: every answer runs
    to its cap, so answers compare on all their tokens."""
    from gmlx import load_tokenizer

    return {str(t): -100 for t in load_tokenizer("demo-vision").eos_token_ids}


# -- helpers --------------------------------------------------------------------------


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*images: str, text: str = QUESTION) -> dict[str, Any]:
    """A user turn: the text, then each image (URL or data URI)."""
    return {"role": "user", "content": [{"type": "text", "text": text}, *map(image_part, images)]}


def chat(oai: openai.OpenAI, messages: list[dict[str, Any]], no_eos: dict[str, float],
         *, model: str = "demo-vision", stream: bool = False) -> tuple[str, int]:
    """The greedy answer and the prompt's token count, streamed or not."""
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                              "temperature": 0, "logit_bias": no_eos}
    if not stream:
        r = oai.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "length"
        return r.choices[0].message.content or "", r.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(**kwargs, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None
    return text, chunks[-1].usage.prompt_tokens


def ant_image(source: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": source}


def ant_b64(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return ant_image({"type": "base64", "media_type": media_type, "data": b64(data)})


def ant_url(url: str) -> dict[str, Any]:
    return ant_image({"type": "url", "url": url})


def ant_message(ant: anthropic.Anthropic, blocks: list[dict[str, Any]], *, stream: bool = False,
                no_eos: dict[str, float] | None = None) -> tuple[str, int]:
    """The greedy answer (to the cap, with ``no_eos``) and the prompt's token count."""
    # This anthropic SDK has no temperature argument: the sampling fields go as extras.
    extra: dict[str, Any] = {"temperature": 0, **({"logit_bias": no_eos} if no_eos else {})}
    kwargs: dict[str, Any] = {"model": "demo-vision", "max_tokens": MAX_TOKENS, "extra_body": extra,
                              "messages": [{"role": "user", "content": blocks}]}
    if stream:
        with ant.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = ant.messages.create(**kwargs)
    text = "".join(b.text for b in m.content if b.type == "text")
    # input_tokens leaves out what the prompt cache served: the prompt is the sum.
    return text, m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def assert_healthy(oai: openai.OpenAI, no_eos: dict[str, float]) -> None:
    """A good image request still answers after a refused one."""
    text, tokens = chat(oai, [user(data_uri(RED))], no_eos)
    assert text and tokens > IMAGE_TOKENS


# -- OpenAI chat ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_answer_depends_on_the_image(oai, images_url, no_eos, stream) -> None:
    red, red_tokens = chat(oai, [user(data_uri(RED))], no_eos, stream=stream)
    blue, blue_tokens = chat(oai, [user(data_uri(BLUE))], no_eos, stream=stream)
    assert red and blue and red != blue
    assert red_tokens == blue_tokens  # same text, one image each
    # The same bytes by URL: the same prompt, the same greedy answer.
    assert chat(oai, [user(f"{images_url}/red.png")], no_eos, stream=stream) == (red, red_tokens)
    assert chat(oai, [user(f"{images_url}/blue.png")], no_eos, stream=stream) == (blue, blue_tokens)


def test_chat_same_image_same_answer_streamed_or_not(oai, no_eos) -> None:
    messages = [user(data_uri(RED))]
    first = chat(oai, messages, no_eos)
    assert chat(oai, messages, no_eos) == first  # a second time (the image cached by digest)
    assert chat(oai, messages, no_eos, stream=True) == first


def test_chat_prompt_tokens_count_each_image(oai, no_eos) -> None:
    _, plain = chat(oai, [user()], no_eos)
    _, one = chat(oai, [user(data_uri(RED))], no_eos)
    _, two = chat(oai, [user(data_uri(RED), data_uri(BLUE))], no_eos)
    assert one - plain >= IMAGE_TOKENS
    assert two - one >= IMAGE_TOKENS


def test_chat_several_images_in_one_message(oai, no_eos) -> None:
    rb = chat(oai, [user(data_uri(RED), data_uri(BLUE))], no_eos)
    br = chat(oai, [user(data_uri(BLUE), data_uri(RED))], no_eos)
    rr = chat(oai, [user(data_uri(RED), data_uri(RED))], no_eos)
    assert rb[0] and rb[1] == br[1] == rr[1]
    assert len({rb[0], br[0], rr[0]}) == 3  # every image and its place is read
    assert chat(oai, [user(data_uri(RED), data_uri(BLUE))], no_eos, stream=True) == rb


def test_chat_images_across_turns(oai, images_url, no_eos) -> None:
    def turns(first: str, second: str) -> list[dict[str, Any]]:
        return [
            user(first),
            {"role": "assistant", "content": "A picture."},
            user(second, text="And this one?"),
        ]

    red_blue = chat(oai, turns(data_uri(RED), data_uri(BLUE)), no_eos)
    blue_blue = chat(oai, turns(data_uri(BLUE), data_uri(BLUE)), no_eos)
    _, last_alone = chat(oai, [user(data_uri(BLUE), text="And this one?")], no_eos)
    assert red_blue[0] and red_blue[0] != blue_blue[0]  # the first turn's image is read
    assert red_blue[1] - last_alone >= IMAGE_TOKENS
    mixed = turns(data_uri(RED), f"{images_url}/blue.png")
    assert chat(oai, mixed, no_eos, stream=True) == red_blue


# -- Responses ----------------------------------------------------------------------------


def responses_input(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": url, "detail": "auto"},
    ]}]


def test_responses_input_image(oai, images_url, no_eos) -> None:
    kwargs: dict[str, Any] = {"model": "demo-vision", "max_output_tokens": 16, "temperature": 0,
                              "extra_body": {"logit_bias": no_eos}}
    red = oai.responses.create(input=responses_input(data_uri(RED)), **kwargs)
    blue = oai.responses.create(input=responses_input(data_uri(BLUE)), **kwargs)
    assert red.output_text and red.output_text != blue.output_text
    text_only = oai.responses.create(input=QUESTION, **kwargs)
    assert red.usage.input_tokens - text_only.usage.input_tokens >= IMAGE_TOKENS
    events = list(oai.responses.create(input=responses_input(f"{images_url}/red.png"),
                                       stream=True, **kwargs))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == streamed == red.output_text
    assert events[-1].response.usage.input_tokens == red.usage.input_tokens
    # The chat route reads the same image the same way.
    assert chat(oai, [user(data_uri(RED))], no_eos)[1] == red.usage.input_tokens


# -- Anthropic -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_image_blocks(ant, oai, images_url, no_eos, stream) -> None:
    text = {"type": "text", "text": QUESTION}
    red = ant_message(ant, [text, ant_b64(RED)], stream=stream, no_eos=no_eos)
    blue = ant_message(ant, [text, ant_b64(BLUE)], stream=stream, no_eos=no_eos)
    assert red[0] and red[0] != blue[0] and red[1] == blue[1]
    by_url = ant_message(ant, [text, ant_url(f"{images_url}/red.png")], stream=stream, no_eos=no_eos)
    assert by_url == red
    assert ant_message(ant, [text, ant_b64(RED)], stream=not stream, no_eos=no_eos) == red
    assert chat(oai, [user(data_uri(RED))], no_eos) == red  # the OpenAI route's prompt


def test_anthropic_keeps_the_block_order(ant, oai, no_eos) -> None:
    """Anthropic's usual order (the image, then the question) reaches the model as
    sent: the same prompt, so the same greedy answer, as the OpenAI chat request with
    its parts in that order, and not the answer to the question asked first."""
    blocks = [ant_b64(RED), {"type": "text", "text": QUESTION}]
    answer = ant_message(ant, blocks, no_eos=no_eos)
    image_first = [{"role": "user", "content": [image_part(data_uri(RED)),
                                                {"type": "text", "text": QUESTION}]}]
    first, second = chat(oai, image_first, no_eos), chat(oai, [user(data_uri(RED))], no_eos)
    assert first[0] != second[0], "the test needs the two orders to answer differently"
    assert answer == first


def test_anthropic_count_tokens_counts_the_image(ant, images_url) -> None:
    def count(*blocks: dict[str, Any]) -> int:
        return ant.messages.count_tokens(
            model="demo-vision", messages=[{"role": "user", "content": list(blocks)}]
        ).input_tokens

    text = {"type": "text", "text": QUESTION}
    alone = count(text)
    with_image = count(text, ant_b64(RED))
    assert with_image - alone >= IMAGE_TOKENS
    assert count(text, ant_url(f"{images_url}/blue.png")) == with_image
    assert count(text, ant_b64(RED), ant_b64(BLUE)) - with_image >= IMAGE_TOKENS
    assert ant_message(ant, [text, ant_b64(RED)])[1] == with_image


# -- estimate and listing ----------------------------------------------------------------


def test_estimate_counts_image_tokens(http) -> None:
    def estimate(*images: str) -> dict[str, Any]:
        r = http.post("/v1/estimate", json={"model": "demo-vision", "messages": [user(*images)]})
        assert r.status_code == 200, r.text
        return r.json()

    alone, one = estimate(), estimate(data_uri(RED))
    assert one["resident"] is True and one["context_ok"] is True
    assert one["prompt_tokens"] - alone["prompt_tokens"] >= IMAGE_TOKENS
    assert estimate(data_uri(RED), data_uri(BLUE))["prompt_tokens"] - one["prompt_tokens"] >= IMAGE_TOKENS


def test_models_mark_the_vision_model(http) -> None:
    r = http.get("/v1/models")
    assert r.status_code == 200
    rows = {m["id"]: m for m in r.json()["data"]}
    assert rows["demo-vision"]["resident"] is True and rows["demo-vision"]["vlm"] is True
    assert rows["demo"]["resident"] is True and rows["demo"]["vlm"] is False


# -- errors ----------------------------------------------------------------------------------


def openai_error(oai: openai.OpenAI, url: str, *, model: str = "demo-vision",
                 stream: bool = False) -> openai.APIStatusError:
    """The error of a chat request whose image (``messages[0].content[1]``) is ``url``."""
    with pytest.raises(openai.APIStatusError) as err:
        r = oai.chat.completions.create(model=model, messages=[user(url)], max_tokens=2,
                                        temperature=0, stream=stream)
        if stream:
            list(r)
    return err.value


def anthropic_error(ant: anthropic.Anthropic, image: dict[str, Any], *,
                    model: str = "demo-vision") -> anthropic.APIStatusError:
    """The error of a message whose image is ``messages[0].content[1]``."""
    with pytest.raises(anthropic.APIStatusError) as err:
        ant.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, image]}])
    return err.value


def responses_error(oai: openai.OpenAI, url: str, *, model: str = "demo-vision") -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        oai.responses.create(model=model, max_output_tokens=16, input=responses_input(url))
    return err.value


WHERE = "messages[0].content[1]"


def check_openai(e: openai.APIStatusError, status: int, *words: str, where: str = WHERE) -> None:
    assert e.status_code == status, e.body
    body = e.body  # the SDK hands over the "error" object
    assert isinstance(body, dict) and body["message"].startswith(f"{where}: "), body
    assert body["param"] == where
    assert body["type"] == ("payload_too_large" if status == 413 else "invalid_request_error")
    for word in words:
        assert word in body["message"], body["message"]


def check_anthropic(e: anthropic.APIStatusError, status: int, *words: str,
                    where: str = WHERE) -> None:
    assert e.status_code == status, e.body
    body = e.body
    assert isinstance(body, dict) and body["type"] == "error", body
    error = body["error"]
    kind = "request_too_large" if status == 413 else "invalid_request_error"
    assert error["type"] == kind and error["message"].startswith(f"{where}: "), error
    for word in words:
        assert word in error["message"], error["message"]


BAD_BASE64 = "data:image/png;base64,@@not base64@@"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_chat_errors(oai, images_url, no_eos, stream) -> None:
    cases = [
        (BAD_BASE64, 400, ["base64"]),
        (data_uri(NOT_AN_IMAGE), 400, ["not a readable image"]),
        (f"{images_url}/fake.png", 400, ["not a readable image"]),
        (f"{images_url}/page.html", 400, ["text/html"]),
        (f"{images_url}/missing.png", 400, ["404"]),
        (data_uri(BIG), 413, ["image_max_bytes"]),
        (f"{images_url}/big.png", 413, ["image_max_bytes"]),
    ]
    for url, status, words in cases:
        check_openai(openai_error(oai, url, stream=stream), status, *words)
        assert_healthy(oai, no_eos)


def test_openai_chat_image_to_text_only_model(oai, no_eos) -> None:
    for stream in (False, True):
        e = openai_error(oai, data_uri(RED), model="demo", stream=stream)
        check_openai(e, 400, "text-only", "'demo'")
    assert chat(oai, [user()], no_eos, model="demo")[0]  # demo still answers text
    assert_healthy(oai, no_eos)


def test_anthropic_errors(ant, oai, images_url, no_eos) -> None:
    cases = [
        (ant_image({"type": "base64", "media_type": "image/png", "data": "@@not base64@@"}),
         400, ["base64"]),
        (ant_b64(NOT_AN_IMAGE), 400, ["not a readable image"]),
        (ant_url(f"{images_url}/missing.png"), 400, ["404"]),
        (ant_b64(BIG), 413, ["image_max_bytes"]),
        (ant_url(f"{images_url}/big.png"), 413, ["image_max_bytes"]),
    ]
    for image, status, words in cases:
        check_anthropic(anthropic_error(ant, image), status, *words)
        assert ant_message(ant, [{"type": "text", "text": QUESTION}, ant_b64(RED)])[0]
    check_anthropic(anthropic_error(ant, ant_b64(RED), model="demo"), 400, "text-only")
    with pytest.raises(anthropic.BadRequestError) as err:  # count_tokens checks images too
        ant.messages.count_tokens(model="demo-vision", messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, ant_b64(NOT_AN_IMAGE)]}])
    check_anthropic(err.value, 400, "not a readable image")
    assert_healthy(oai, no_eos)


@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
def test_anthropic_error_names_the_block_as_sent(ant, system) -> None:
    """The part path counts the client's own blocks: an image sent first is
    ``content[0]``, and a top-level ``system`` is no message."""
    extra: dict[str, Any] = {"system": "Describe images."} if system else {}
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(model="demo-vision", max_tokens=2, **extra, messages=[
            {"role": "user", "content": [ant_b64(NOT_AN_IMAGE), {"type": "text", "text": QUESTION}]},
        ])
    check_anthropic(err.value, 400, "not a readable image", where="messages[0].content[0]")


def test_responses_errors(oai, images_url, no_eos) -> None:
    cases = [
        (BAD_BASE64, 400, ["base64"]),
        (data_uri(NOT_AN_IMAGE), 400, ["not a readable image"]),
        (f"{images_url}/missing.png", 400, ["404"]),
        (data_uri(BIG), 413, ["image_max_bytes"]),
    ]
    for url, status, words in cases:
        e = responses_error(oai, url)
        assert e.status_code == status, e.body
        message = e.body["message"]
        assert "content[1]: " in message, message
        for word in words:
            assert word in message, message
        assert_healthy(oai, no_eos)
    e = responses_error(oai, data_uri(RED), model="demo")
    assert e.status_code == 400 and "text-only" in e.body["message"]


def test_responses_error_names_the_input_item(oai) -> None:
    """A Responses request has ``input`` items, not ``messages``: the path says so."""
    e = responses_error(oai, data_uri(NOT_AN_IMAGE))
    assert e.status_code == 400
    assert e.body["message"].startswith("input[0].content[1]: "), e.body["message"]


def test_estimate_errors(http) -> None:
    def estimate(url: str) -> httpx.Response:
        return http.post("/v1/estimate", json={"model": "demo-vision", "messages": [user(url)]})

    r = estimate(BAD_BASE64)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{WHERE}: ")
    assert estimate(data_uri(BIG)).status_code == 413
    assert estimate(data_uri(RED)).status_code == 200


def test_loopback_url_refused_by_default(default_server, images_url) -> None:
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", timeout=30,
                           max_retries=0)
    e = openai_error(client, f"{images_url}/red.png")
    check_openai(e, 400, "loopback", "server.image_fetch_private")
    r = httpx.get(f"{default_server.url}/v1/models", timeout=30)
    assert r.status_code == 200 and {m["id"]: m for m in r.json()["data"]}["demo-vision"]["resident"] is False
