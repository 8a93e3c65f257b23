"""Images beside text streams: what a 1-image request costs the streams decoding on the
same model, and its time to first token against mlx-vlm's own generator (the peer), in
one run.

    python benchmarks/vision.py                  # the demo-vision shape: seconds on a CPU
    python benchmarks/vision.py --shape small    # a 224px SigLIP tower, 256-token images

gmlx prefills an image request up to its last image from embeddings on the model's
worker, between two decode steps: the running streams wait for that one image's tower
and prefill, then decode on while the batch prefills the request's text. The table
shows, for text streams decoding at width ``--width``: their inter-token gap alone,
the longest gap while a 1-image request is admitted (the stall), the longest gap
while a text request of the same prompt length is admitted (the batch's own chunked
prefill, for scale), and the image request's TTFT beside mlx-vlm's ``generate_step``
for the same prompt and image, alone. Random weights: speed does not depend on them.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import threading
import time
from pathlib import Path

SHAPES = {
    "demo": ({}, {}),
    "small": (
        {"hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1536, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 64, "query_pre_attn_scalar": 64, "mm_tokens_per_image": 256},
        {"hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1536, "num_attention_heads": 6,
         "patch_size": 14, "image_size": 224},
    ),
}


def png(color: tuple[int, int, int], size: int = 320) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (size, size), color)
    for x in range(0, size, 7):
        image.putpixel((x, (x * 3) % size), (255 - color[0], 40, 200))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


class Stream:
    """A text request decoding in a thread, with the time of each token."""

    def __init__(self, engine, model: str, text: str, tokens: int) -> None:
        from gmlx.engine.types import ChatRequest, Message

        self.times: list[float] = []
        req = ChatRequest(model=model, messages=(Message.text("user", text),), max_tokens=tokens)
        eos = engine.render_sync(req).worker.loaded.tokenizer.eos_token_ids
        no_end = {"temperature": 0, "logit_bias": dict.fromkeys(eos, -100.0)}  # decode on
        req = ChatRequest(model=model, messages=req.messages, max_tokens=tokens, sampling=no_end)
        self.job = engine.start_sync(req)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for event in self.job.handle:
            if event.token_ids:
                self.times.append(time.perf_counter())

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= b <= end]


def ttft(engine, req) -> float:
    start = time.perf_counter()
    job = engine.start_sync(req)
    for event in job.handle:
        if event.token_ids:
            first = time.perf_counter() - start
            job.handle.cancel()
            break
    for _ in job.handle:  # drain to the final event
        pass
    return first


def image_request(model: str, image: bytes, words: int):
    from gmlx.engine.types import ChatRequest, ImagePart, Message, TextPart

    text = "Describe the picture in detail. " * words
    return ChatRequest(model=model, max_tokens=4, sampling={"temperature": 0},
                       messages=(Message("user", (ImagePart(data_uri(image)), TextPart(text))),))


def measure(engine, model: str, width: int, image: bytes, words: int) -> dict[str, float]:
    from gmlx.engine.types import ChatRequest, ImagePart, Message, TextPart

    prompt = "Describe the picture in detail. " * words
    image_req = ChatRequest(model=model, max_tokens=4, sampling={"temperature": 0},
                            messages=(Message("user", (ImagePart(data_uri(image)), TextPart(prompt))),))
    rendered = engine.render_sync(image_req)
    n_prompt = len(rendered.ids)
    # A text request as long as the image one (its image run spelled as words).
    text_req = ChatRequest(model=model, max_tokens=4, sampling={"temperature": 0},
                           messages=(Message.text("user", prompt + " word" * (n_prompt - len(
                               engine.render_sync(ChatRequest(model=model, messages=(
                                   Message.text("user", prompt),))).ids))),))
    ttft(engine, image_req)  # warm: compiles, fills nothing (a different image follows)

    out: dict[str, float] = {"prompt_tokens": n_prompt}
    for label, req in (("image", image_req), ("text", text_req)):
        streams = [Stream(engine, model, f"Stream {i} tells a long story.", 4000) for i in range(width)]
        deadline = time.monotonic() + 120
        while min(len(s.times) for s in streams) < 24 and time.monotonic() < deadline:
            time.sleep(0.05)  # until every stream decodes steadily
        if label == "image":  # a fresh image: no cached prefix
            req = ChatRequest(model=model, max_tokens=4, sampling={"temperature": 0},
                              messages=(Message("user", (ImagePart(data_uri(png((9, 99, 199)))),
                                                         TextPart(prompt))),))
        start = time.perf_counter()
        first = ttft(engine, req)
        end = time.perf_counter()
        time.sleep(max(0.5, 6 * out.get("gap_p50_ms", 100) / 1e3))
        for s in streams:
            s.job.handle.cancel()
            s.thread.join(30)
        gaps = [g for s in streams for g in s.gaps(end=start)]
        if not gaps:
            raise SystemExit(f"the text streams did not decode: {[len(s.times) for s in streams]} tokens, {[s.job.handle for s in streams]}")
        during = [g for s in streams for g in s.gaps(start, end + 0.2)]
        out["gap_p50_ms"] = statistics.median(gaps[len(gaps) // 4:]) * 1e3
        out[f"{label}_stall_ms"] = max(during, default=0.0) * 1e3
        out[f"{label}_ttft_busy_ms"] = first * 1e3
    out["image_ttft_alone_ms"] = min(
        ttft(engine, image_request(model, png((200, 10, 10 + i)), words)) for i in range(3)) * 1e3
    return out


def peer_ttft(folder: Path, ids: list[int], pixels) -> float:
    """mlx-vlm's own generator, alone, on the same prompt ids and pixels gmlx renders:
    the time to its first token (its tower, its prefill, one sampled token)."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load_model

    model = load_model(folder)
    input_ids = mx.array([ids])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for token, _ in generate_step(input_ids, model, mx.array(pixels[None]),
                                      mx.ones(input_ids.shape), max_tokens=1, temperature=0.0):
            mx.eval(token)
            best = min(best, time.perf_counter() - start)
            break
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="demo")
    parser.add_argument("--width", type=int, default=4, help="text streams decoding meanwhile")
    parser.add_argument("--words", type=int, default=8, help="prompt text repeats beside the image")
    parser.add_argument("--no-peer", action="store_true", help="skip mlx-vlm's generator")
    args = parser.parse_args()

    from gmlx.compose import build_engine, build_registry
    from gmlx.config import Settings
    from gmlx.engine.loading import demo_vision

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"vision-{args.shape}"
        text, vision = SHAPES[args.shape]
        demo_vision.build(folder, text=text, vision=vision)
        settings, (model,) = Settings().with_models([str(folder)])
        registry = build_registry(settings)
        engine = build_engine(settings, registry)
        try:
            image = png((30, 160, 60))
            gmlx = measure(engine, model, args.width, image, args.words)
            rendered = engine.render_sync(image_request(model, png((200, 10, 10)), args.words))
        finally:
            registry.close()
        peer = None if args.no_peer else peer_ttft(folder, rendered.ids, rendered.images[0].pixels)

    print(f"\nshape {args.shape}: {gmlx['prompt_tokens']:.0f} prompt tokens with one image, "
          f"{args.width} text streams decoding")
    rows = [
        ("text streams' inter-token gap (p50)", gmlx["gap_p50_ms"]),
        ("longest gap while a 1-image request is admitted", gmlx["image_stall_ms"]),
        ("longest gap while a same-length text request is admitted", gmlx["text_stall_ms"]),
        ("image request TTFT beside the streams", gmlx["image_ttft_busy_ms"]),
        ("text request TTFT beside the streams", gmlx["text_ttft_busy_ms"]),
        ("image request TTFT alone: gmlx", gmlx["image_ttft_alone_ms"]),
    ]
    if peer is not None:
        rows.append(("image request TTFT alone: mlx-vlm generate_step (peer)", peer))
    width = max(len(r[0]) for r in rows)
    for label, ms in rows:
        print(f"  {label:<{width}}  {ms:9.1f} ms")
    print(f"  {'stall / gap p50':<{width}}  {gmlx['image_stall_ms'] / gmlx['gap_p50_ms']:9.1f} x")
    if peer is not None:
        print(f"  {'TTFT alone, gmlx / peer':<{width}}  {gmlx['image_ttft_alone_ms'] / peer:9.2f} x")


if __name__ == "__main__":
    main()
