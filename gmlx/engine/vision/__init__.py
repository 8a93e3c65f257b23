"""The vision part of a model: how a request's images become prompt tokens and the
embeddings those tokens stand for.

A vision model is served as its text model (an mlx-lm class, run by the batch like
any other) plus a :class:`Vision`: mlx-vlm's vision tower and projector, whose
``language_model`` is that same text model (its embedding table is shared, not
loaded twice). The chat template writes one image marker per image; :meth:`Vision.expand`
widens each marker into the run of image tokens the model reads, so counts, estimates
and the prompt cache see the real prompt length. At admission the part of the prompt
up to the last image is prefilled from embeddings (``gmlx.engine.vision.prefill``);
everything after it, and decoding, is plain text work in the batch.

Families: Gemma 3 (``gemma3``), from an mlx-vlm model folder or from a GGUF language
model with a llama.cpp ``mmproj`` projector file. Gemma 3 places text positions after
an image one by one (1-D RoPE), so once its image tokens are in the KV cache the text
model continues it as any other; families whose positions depend on the image grid
(Qwen2-VL's M-RoPE) would need positions the batch cannot give yet.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gmlx.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx import nn

    from gmlx.engine.media import LoadedImage

FAMILIES = ("gemma3",)


@dataclass
class Vision:
    """A loaded vision tower and projector, and the facts that place images in a prompt.

    Args:
        encoder: mlx-vlm's model; its ``language_model`` is the served text model.
        family: the model family (``gemma3``).
        image_size: the square the tower reads, in pixels.
        image_mean, image_std: per-channel normalization after scaling to [0, 1].
        tokens_per_image: image tokens one image becomes.
        image_token_id: the token that stands for one image embedding.
        begin_id, end_id: the markers around an image's run (the template writes
            ``begin_id`` once per image).
        around: tokens placed before ``begin_id`` and after ``end_id``.
        source: the folder or projector file it came from.
    """

    encoder: nn.Module
    family: str
    image_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    tokens_per_image: int
    image_token_id: int
    begin_id: int
    end_id: int
    around: tuple[int, ...]
    source: Path

    def describe(self) -> str:
        return (f"vision: {self.family}, {self.image_size}px images as "
                f"{self.tokens_per_image} tokens, from {self.source.name}")

    # -- prompt -----------------------------------------------------------------

    def expand(self, ids: Sequence[int], count: int) -> list[int]:
        """``ids`` with each image marker widened into the run the model reads:
        ``around``, the begin marker, ``tokens_per_image`` image tokens, the end
        marker, ``around``. Raises InvalidRequestError when the template placed a
        different number of markers than the request has images."""
        placed = sum(1 for t in ids if t == self.begin_id)
        if placed != count:
            raise InvalidRequestError(
                f"The model's chat template placed {placed} image marker(s) for the "
                f"request's {count} image(s), so its images cannot be placed in the prompt.",
                param="messages",
            )
        run = [*self.around, self.begin_id, *[self.image_token_id] * self.tokens_per_image,
               self.end_id, *self.around]
        out: list[int] = []
        for t in ids:
            out.extend(run if t == self.begin_id else (t,))
        return out

    def spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """The [start, end) of each run of image tokens in ``ids``, in order."""
        out, start = [], None
        for i, t in enumerate(ids):
            if t == self.image_token_id and start is None:
                start = i
            elif t != self.image_token_id and start is not None:
                out.append((start, i))
                start = None
        if start is not None:
            out.append((start, len(ids)))
        return out

    # -- pixels and embeddings ------------------------------------------------------

    def pixels(self, image: LoadedImage) -> np.ndarray:
        """An image as the tower reads it: RGB, resized to the square input (bilinear),
        scaled to [0, 1] and normalized; float32, channels first."""
        from PIL import Image

        with Image.open(io.BytesIO(image.data)) as im:
            rgb = im.convert("RGB").resize((self.image_size, self.image_size),
                                           Image.Resampling.BILINEAR)
            a = np.asarray(rgb, dtype=np.float32) / 255.0
        a = (a - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return np.ascontiguousarray(a.transpose(2, 0, 1))

    def embed(self, ids: Sequence[int], pixels: Sequence[np.ndarray],
              features: mx.array) -> mx.array:
        """The input embeddings of ``ids`` (a prompt whose image runs hold one image of
        ``pixels`` each, in order), shape [1, len(ids), hidden], as mlx-vlm computes
        them: the text tokens' embeddings with each image's projected features
        (``features``, from :meth:`tower`) in its run. The text model scales them as it
        scales its own. mlx-vlm takes the pixels too, only to know there are images."""
        import mlx.core as mx

        input_ids = mx.array([list(ids)], dtype=mx.int32)
        out = self.encoder.get_input_embeddings(
            input_ids, mx.array(np.stack(pixels)), mask=mx.ones(input_ids.shape, dtype=mx.int32),
            cached_image_features=features,
        )
        return out.inputs_embeds

    def tower(self, pixels: Sequence[np.ndarray]) -> Iterator[mx.array | None]:
        """The images' projected features, computed a piece at a time: yields None after
        each piece (the patch embedding, each encoder layer, evaluated), and the
        features [images, tokens_per_image, hidden] last. The same arithmetic as
        mlx-vlm's tower, cut where a caller may let other work run in between."""
        import mlx.core as mx

        vm = self.encoder.vision_tower.vision_model
        dtype = self.encoder.language_model.model.embed_tokens(mx.array([0])).dtype
        x = vm.embeddings(mx.array(np.stack(pixels)).transpose(0, 2, 3, 1).astype(dtype))
        mx.eval(x)
        yield None
        for layer in vm.encoder.layers:
            x = layer(x, mask=None)
            mx.eval(x)
            yield None
        features = self.encoder.multi_modal_projector(vm.post_layernorm(x))
        mx.eval(features)
        yield features


def share_text_model(encoder: Any, model: nn.Module) -> None:
    """Point mlx-vlm's model at the served text model (dropping its own copy): mlx-lm's
    VLM classes wrap the text model in ``language_model``; a GGUF's text model is its
    own."""
    encoder.language_model = getattr(model, "language_model", model)


__all__ = ["FAMILIES", "Vision", "share_text_model"]
