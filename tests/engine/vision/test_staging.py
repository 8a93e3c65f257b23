"""An image request is prefilled a piece per decode step (``Batch._stage``): the text
streams of the batch keep decoding meanwhile, and a staged request can leave (a cancel,
the governor) without touching them."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from gmlx.engine.batch import Batch
from gmlx.engine.loading import load_model
from gmlx.engine.media import DEFAULT_POLICY, load_image
from gmlx.engine.prompt_cache import PromptCache
from gmlx.engine.requests import ActiveRequest, RequestHandle, RequestState
from gmlx.engine.stats import WorkerStats
from gmlx.engine.types import GenerateRequest, ImagePart, PromptImage, SamplingParams


def png_uri(color: str) -> str:
    import base64

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 40), color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo-vision")


@pytest.fixture
def batch(loaded) -> Iterator[Batch]:
    b = Batch(loaded, width=4, prefill_step_size=512, prompt_cache=PromptCache(1 << 26))
    b.open()
    yield b
    b.close()


def active(loaded, text: str, *colors: str, max_tokens: int = 64) -> ActiveRequest:
    vision = loaded.vision
    content = [*({"type": "image"} for _ in colors), {"type": "text", "text": text}]
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": content}],
                                       add_generation_prompt=True)
    images = ()
    if colors:
        ids = vision.expand(ids, len(colors))
        read = [load_image(ImagePart(png_uri(c)), DEFAULT_POLICY, where="x") for c in colors]
        images = tuple(PromptImage(i.sha256, vision.pixels(i)) for i in read)
    # the end-of-sequence token is banned so the text stream outlasts the staging
    eos = dict.fromkeys(loaded.tokenizer.eos_token_ids, -100.0)
    request = GenerateRequest(tuple(ids), max_tokens=max_tokens, images=images,
                              sampling=SamplingParams(temperature=0.0, logit_bias=eos))
    return ActiveRequest.prepare(RequestHandle(request, lambda _: None), loaded.tokenizer)


def decoding_text(loaded, batch: Batch, stats: WorkerStats) -> ActiveRequest:
    """A text request admitted and stepped until it decodes."""
    text = active(loaded, "Tell me a story about Paris.")
    batch.admit(text)
    while text.state is not RequestState.DECODE:
        batch.step(stats)
    return text


def test_text_streams_decode_while_an_image_is_staged(loaded, batch: Batch) -> None:
    stats = WorkerStats()
    text = decoding_text(loaded, batch, stats)
    image = active(loaded, "What is this?", "red", max_tokens=4)
    batch.admit(image)
    assert image.uid is not None and image.uid < 0 and image.uid in batch.running
    assert batch.free == 2  # a staged request holds its slot
    before, pieces = text.generated, 0
    while image.uid < 0:
        batch.step(stats)
        pieces += 1
    # the tower's patch embedding, its 2 layers, the features, one prefill chunk: each a
    # step in which the text stream decoded a token (the first of them may hand out
    # again the token read early when its prompt ended)
    assert pieces >= 4 and text.generated - before >= pieces - 1
    assert image.warm_tokens == 0 and image.uid in batch.running
    ended = []
    while image.uid in batch.running:
        ended += batch.step(stats)
    assert image in [a for a, _, _ in ended] and image.generated >= 1


def test_a_staged_request_leaves_alone(loaded, batch: Batch) -> None:
    stats = WorkerStats()
    text = decoding_text(loaded, batch, stats)
    image = active(loaded, "What is this?", "blue")
    batch.admit(image)
    batch.step(stats)  # one piece of its tower
    uid = image.uid
    batch.remove(image, keep_kv=False)  # what a cancel or the governor does
    batch.running.pop(uid)  # the worker's finish
    assert not batch._staged and batch.free == 3
    before = text.generated
    for _ in range(3):
        assert batch.step(stats) == []
    assert text.generated == before + 3
    assert batch.prompt_cache.stats()["entries"] == 0  # a staged request's partial KV is not kept


def test_a_failing_staged_request_ends_alone(loaded, batch: Batch, monkeypatch) -> None:
    from gmlx.engine.types import FinishReason
    from gmlx.engine.vision.prefill import Staged

    stats = WorkerStats()
    text = decoding_text(loaded, batch, stats)

    def broken(self, model, vision, chunk):
        raise RuntimeError("tower exploded")

    monkeypatch.setattr(Staged, "advance", broken)
    image = active(loaded, "What is this?", "green")
    batch.admit(image)
    ended = batch.step(stats)
    assert [(a, r) for a, r, _ in ended] == [(image, FinishReason.ERROR)]
    assert "tower exploded" in str(ended[0][2]) and text.uid in batch.running
    before = text.generated
    batch.step(stats)
    assert text.generated == before + 1
