"""Serving a tiny Gemma 3 vision model end to end, real MLX: built from the same random
weights as an mlx-vlm folder and as a GGUF with an mmproj projector, both loaded
through ``load_model`` (the GGUF's projector from a config file's ``mmproj:``), and
their greedy answers checked against each other and against mlx-vlm's own forward pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.chat import Engine, Rendered
from gmlx.engine.errors import InvalidRequestError, ModelSourceError
from gmlx.engine.loading import load_model
from gmlx.engine.types import ChatRequest, FinishReason, ImagePart, Message, TextPart, Usage
from gmlx.engine.vision.prefill import images_end

from .models import data_uri, png, write_models

MAX_TOKENS = 12
GRADIENT, CHECKS, BLUE = png("gradient"), png("checks", 96, 48), png("blue", 40, 72)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The folder, the GGUF and its mmproj."""
    return write_models(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def engine(files: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """An engine serving the folder (``folder``), the GGUF with its projector
    (``gguf``, configured as a user would) and the text-only ``demo``."""
    from gmlx.compose import build_engine, build_registry
    from gmlx.config import load_settings

    folder, gguf, mmproj = files
    config = tmp_path_factory.mktemp("config") / "gmlx.yaml"
    config.write_text(
        "models:\n"
        f"  folder: {{source: '{folder}'}}\n"
        f"  gguf: {{source: '{gguf}', mmproj: '{mmproj}'}}\n"
    )
    settings, _ = load_settings(config).with_models(["demo"])
    registry = build_registry(settings, warmup=False)
    try:
        yield build_engine(settings, registry)
    finally:
        registry.close()


def ask(model: str, *images: bytes, text: str = "What is in the picture?",
        max_tokens: int = MAX_TOKENS) -> ChatRequest:
    parts = (*(ImagePart(data_uri(i)) for i in images), TextPart(text))
    return ChatRequest(model=model, messages=(Message("user", parts),), max_tokens=max_tokens,
                       sampling={"temperature": 0})


def run(engine: Engine, req: ChatRequest) -> tuple[list[int], FinishReason, Usage]:
    """The greedy token ids of a request (an end-of-sequence token is not among them),
    its finish and its usage."""
    events = list(engine.start_sync(req).handle)
    final = events[-1]
    assert final.error is None and final.finish_reason is not None and final.usage is not None
    return [t for e in events for t in e.token_ids], final.finish_reason, final.usage


def vision_of(r: Rendered) -> Any:
    return r.worker.loaded.vision


def forget(engine: Engine, model: str) -> None:
    """Empty the model's prompt cache (earlier tests' prompts share prefixes)."""
    engine.render_sync(ask(model)).worker.prompt_cache.reset()


# -- loading -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["folder", "gguf"])
def test_both_sources_load_a_vision_part(engine: Engine, model: str) -> None:
    r = engine.render_sync(ask(model, GRADIENT))
    vision = vision_of(r)
    tok = r.worker.loaded.tokenizer
    assert vision is not None and vision.family == "gemma3"
    assert (vision.image_size, vision.tokens_per_image) == (64, 16)
    assert vision.image_token_id == tok.token_to_id("<image_soft_token>")
    assert (vision.begin_id, vision.end_id) == (tok.token_to_id("<start_of_image>"),
                                                tok.token_to_id("<end_of_image>"))
    # The served text model is the one the tower feeds: its embedding table is shared.
    assert vision.encoder.language_model is getattr(r.worker.loaded.model, "language_model",
                                                    r.worker.loaded.model)
    assert r.images[0].pixels.shape == (3, 64, 64) and r.images[0].pixels.dtype == np.float32


def test_folder_and_gguf_render_the_same_prompt(engine: Engine) -> None:
    folder = engine.render_sync(ask("folder", GRADIENT, CHECKS))
    gguf = engine.render_sync(ask("gguf", GRADIENT, CHECKS))
    assert folder.ids == gguf.ids
    for a, b in zip(folder.images, gguf.images, strict=True):
        assert a.sha256 == b.sha256
        np.testing.assert_array_equal(a.pixels, b.pixels)


# -- greedy output conditions on the image -----------------------------------------------


@pytest.mark.parametrize("model", ["folder", "gguf"])
def test_different_images_give_different_tokens(engine: Engine, model: str) -> None:
    text = "Describe it."
    gradient, _, _ = run(engine, ask(model, GRADIENT, text=text))
    checks, _, _ = run(engine, ask(model, CHECKS, text=text))
    blue, _, _ = run(engine, ask(model, BLUE, text=text))
    assert len({tuple(gradient), tuple(checks), tuple(blue)}) == 3


@pytest.mark.parametrize("model", ["folder", "gguf"])
def test_the_same_image_again_is_a_cache_hit_with_the_same_answer(engine: Engine,
                                                                  model: str) -> None:
    forget(engine, model)
    req = ask(model, CHECKS, text="Once more.")
    end = images_end(vision_of(engine.render_sync(req)), engine.render_sync(req).ids)
    first, _, usage1 = run(engine, req)
    second, _, usage2 = run(engine, req)
    assert usage1.cached_tokens < end  # a miss: the image ran through the tower
    assert usage2.cached_tokens > end  # a hit past the image
    assert second == first


@pytest.mark.parametrize("model", ["folder", "gguf"])
def test_another_image_in_between_changes_nothing(engine: Engine, model: str) -> None:
    forget(engine, model)
    text = "What colour?"
    a1, _, _ = run(engine, ask(model, BLUE, text=text))
    b, _, usage_b = run(engine, ask(model, GRADIENT, text=text))
    a2, _, usage_a2 = run(engine, ask(model, BLUE, text=text))
    req = ask(model, GRADIENT, text=text)
    assert usage_b.cached_tokens < images_end(vision_of(engine.render_sync(req)),
                                              engine.render_sync(req).ids)
    assert usage_a2.cached_tokens > images_end(vision_of(engine.render_sync(req)),
                                               engine.render_sync(req).ids)
    assert a1 == a2 and b != a1


def test_concurrent_image_requests_answer_as_alone(engine: Engine) -> None:
    """Images prefilled between decode steps of other streams (and a text stream beside
    them) leave every answer as it is alone; nothing comes from the prompt cache."""
    reqs = [ask("folder", image, text="Together?") for image in (GRADIENT, CHECKS, BLUE)]
    reqs.append(ChatRequest(model="folder", messages=(Message.text("user", "No image."),),
                            max_tokens=MAX_TOKENS, sampling={"temperature": 0}))
    alone = []
    for r in reqs:
        forget(engine, "folder")
        alone.append(run(engine, r)[0])
    forget(engine, "folder")
    jobs = [engine.start_sync(r) for r in reqs]
    together = [[t for e in job.handle for t in e.token_ids] for job in jobs]
    assert together == alone
    assert len({tuple(t) for t in alone}) == 4


# -- the folder, the GGUF and mlx-vlm agree --------------------------------------------


@pytest.mark.parametrize("images", [(GRADIENT,), (CHECKS, BLUE)], ids=["one", "two"])
def test_folder_and_gguf_give_the_same_tokens(engine: Engine, images: tuple[bytes, ...]) -> None:
    """Both hold the same float32 weights (the GGUF's norms as 1 + w, so within float32
    rounding of them): their greedy tokens agree."""
    folder = run(engine, ask("folder", *images, text="Compare."))
    gguf = run(engine, ask("gguf", *images, text="Compare."))
    assert folder[:2] == gguf[:2]


def reference_tokens(folder: Path, ids: list[int], pixels: list[np.ndarray], n: int) -> list[int]:
    """``n`` greedy tokens of mlx-vlm's own model loaded from ``folder``: the prompt's
    embeddings from ``get_input_embeddings``, then its language model step by step."""
    from mlx_vlm.utils import load_model as vlm_load

    model = vlm_load(folder)
    input_ids = mx.array([ids], dtype=mx.int32)
    embeds = model.get_input_embeddings(
        input_ids, mx.array(np.stack(pixels)), mask=mx.ones(input_ids.shape, dtype=mx.int32)
    ).inputs_embeds
    lm = model.language_model
    cache = lm.make_cache()
    logits = lm(input_ids, inputs_embeds=embeds, cache=cache).logits
    out: list[int] = []
    for _ in range(n):
        token = mx.argmax(logits[0, -1]).item()
        out.append(int(token))
        logits = lm(mx.array([[token]], dtype=mx.int32), cache=cache).logits
    return out


@pytest.mark.parametrize("images", [(GRADIENT,), (BLUE, CHECKS)], ids=["one", "two"])
def test_the_image_path_matches_mlx_vlm(engine: Engine, files: tuple[Path, Path, Path],
                                        images: tuple[bytes, ...]) -> None:
    req = ask("folder", *images, text="As mlx-vlm says.")
    r = engine.render_sync(req)
    tokens, finish, _ = run(engine, req)
    reference = reference_tokens(files[0], r.ids, [i.pixels for i in r.images], MAX_TOKENS)
    assert tokens == reference[: len(tokens)]
    if finish is FinishReason.STOP:  # ended by an end-of-sequence token
        assert reference[len(tokens)] in r.worker.loaded.tokenizer.eos_token_ids
    else:
        assert len(tokens) == MAX_TOKENS


# -- counting ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["folder", "gguf"])
def test_counts_and_estimates_count_image_tokens(engine: Engine, model: str) -> None:
    one = ask(model, GRADIENT, text="Count.")
    two = ask(model, GRADIENT, BLUE, text="Count.")
    r1, r2 = engine.render_sync(one), engine.render_sync(two)
    vision = vision_of(r2)
    image_id, per_image = vision.image_token_id, vision.tokens_per_image
    assert r1.ids.count(image_id) == per_image
    assert r2.ids.count(image_id) == 2 * per_image
    spans = vision.spans(r2.ids)
    assert [end - start for start, end in spans] == [per_image, per_image]
    for start, end in spans:  # each run in its markers
        assert (r2.ids[start - 1], r2.ids[end]) == (vision.begin_id, vision.end_id)
    # The second image adds its run and markers (and the text around them) only.
    assert len(r2.ids) - len(r1.ids) == per_image + 2 + 2 * len(vision.around)

    assert asyncio.run(engine.count_tokens(two)) == len(r2.ids)
    estimate = asyncio.run(engine.estimate(two))
    assert estimate.resident and estimate.prompt_tokens == len(r2.ids)
    assert engine.estimate_sync(one).prompt_tokens == len(r1.ids)


@pytest.mark.parametrize("model", ["folder", "gguf"])
def test_a_follow_up_turn_reuses_the_image_from_the_cache(engine: Engine, model: str) -> None:
    forget(engine, model)
    first = ask(model, GRADIENT, text="First turn.")
    answer_ids, _, _ = run(engine, first)
    r = engine.render_sync(first)
    answer = r.worker.loaded.tokenizer.decode(answer_ids)
    follow = ChatRequest(
        model=model,
        messages=(*first.messages, Message.text("assistant", answer),
                  Message.text("user", "And then?")),
        max_tokens=4, sampling={"temperature": 0},
    )
    tokens, _, usage = run(engine, follow)
    assert usage.cached_tokens > images_end(vision_of(r), r.ids)
    # The same answer as with nothing cached: what the cache gave back is that image.
    forget(engine, model)
    cold, _, usage = run(engine, follow)
    assert usage.cached_tokens == 0 and cold == tokens


def test_an_estimate_counts_a_cached_image_as_warm(engine: Engine) -> None:
    forget(engine, "folder")
    req = ask("folder", GRADIENT, text="Estimate me.")
    run(engine, req)
    r = engine.render_sync(req)
    assert engine.estimate_sync(req).warm_tokens > images_end(vision_of(r), r.ids)


# -- errors --------------------------------------------------------------------------------


def test_an_mmproj_for_a_folder_is_refused(files: tuple[Path, Path, Path]) -> None:
    folder, _, mmproj = files
    with pytest.raises(ModelSourceError, match="mmproj"):
        load_model(folder, mmproj=mmproj)


def test_a_missing_mmproj_is_refused(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, gguf, _ = files
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model(gguf, mmproj=tmp_path / "mmproj-missing.gguf")


def test_an_image_to_a_text_only_model_names_the_part(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.start_sync(ask("demo", GRADIENT))
    message = str(info.value)
    assert message.startswith("messages[0].content[0]: ")
    assert "text-only" in message
