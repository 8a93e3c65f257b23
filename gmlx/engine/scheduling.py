"""A worker's scheduling choices, as pure functions: how much prompt a step prefills,
how many prompts share it, whom the governor sheds, and what a full queue tells a
client. The worker gathers the numbers; these decide. Each is tested without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from gmlx.engine.types import GenerateRequest, SamplingParams

DEFAULT_DECODE_BATCH = 8  # streams decoding together, where nothing else sets the width
DEFAULT_PREFILL_STEP = 512  # CPU: unfused attention makes the chunk's transient large
MIN_SHARED_PREFILL_STEP = 64  # the smallest prefill chunk while streams decode
SHARED_PREFILL_PARTS = 4  # while streams decode, a step prefills 1-4 quarters of a chunk
DEFAULT_REQUEST_S = 5.0  # a request's duration assumed before any has finished
RETRY_AFTER_RANGE = (2, 60)  # seconds a refused client is told to wait, at least and at most


def default_prefill_step() -> int:
    """Prompt tokens per prefill step: 512 on the CPU, 2048 where attention is fused
    (Metal, CUDA), so its transient stays small and fewer, larger steps win."""
    from gmlx.engine.capacity import backend

    return DEFAULT_PREFILL_STEP if backend() == "cpu" else 2048


def prefill_step(step_size: int, decoding: int, waiting: int = 1) -> int:
    """Prompt tokens one step may prefill while ``decoding`` streams decode and ``waiting``
    prompts wait to prefill. With nobody decoding, the whole ``step_size``, for the
    fastest prefill. Beside decoding streams, the waiting prompts' share of the requests
    in the batch, rounded up to quarters of ``step_size`` (at least one; a chunk of more
    than 256 tokens takes the products' path the warm-up compiles, whatever its size):
    every step waits for its prefill chunk, so a long prompt arriving in
    whole chunks would hold each running stream's next token for a whole chunk (a
    512-token chunk at a 2k context takes ~250 ms on a 2-core CPU), while a burst of
    prompts beside a few running streams must not be admitted a quarter chunk a step
    (32 prompts of 128 tokens beside one stream take 32 steps so on the CPU, 8 with
    CUDA's 2048-token chunk; 16 and 4 by their share)."""
    if not decoding:
        return step_size
    parts = max(1, -(-SHARED_PREFILL_PARTS * waiting // (waiting + decoding)))
    return max(MIN_SHARED_PREFILL_STEP, step_size * parts // SHARED_PREFILL_PARTS)


def prefill_width(prompt_lengths: Iterable[int], step: int) -> int:
    """How many prompts prefill together in the next step, given the prompt tokens
    each has left to prefill, in arrival order: as many as keep that step within
    ``step`` tokens, counting each at the longest one's chunk (the batch is padded to
    it). A burst of short prompts then prefills in one step instead of one step each,
    while the memory a prefill step takes stays within what the capacity model prices
    for one chunk. A prompt with nothing left (0: its last token goes to its first
    decode step) takes a place but no row, so the next prompt starts beside it. At
    least one."""
    width = rows = longest = 0
    for length in prompt_lengths:
        if not length:
            width += 1
            continue
        wider = max(longest, min(length, step))
        if rows and (rows + 1) * wider > step:
            break
        width, rows, longest = width + 1, rows + 1, wider
    return max(1, width)


class Running(Protocol):
    """A running request, as the shed choice sees it."""

    @property
    def tokens_held(self) -> int:
        """Its prompt and generated tokens: the KV it holds."""
        ...


R = TypeVar("R", bound=Running)


def shed_victim(running: Iterable[R]) -> R | None:
    """The request to shed when memory runs out: the one holding the most tokens
    (the first of equals), which frees the most. None when nothing runs."""
    return max(running, key=lambda r: r.tokens_held, default=None)


def queue_full(waiting: int, queue_cap: int, free_slots: int) -> bool:
    """Whether one more request must be refused: ``waiting`` requests have no slot
    yet, the free slots take as many, and the queue holds ``queue_cap`` beyond them."""
    return waiting >= queue_cap + free_slots


def queued(waiting: int, free_slots: int) -> int:
    """Requests waiting beyond the free slots (those are about to start)."""
    return max(0, waiting - free_slots)


def queue_eta_s(queued: int, decode_batch: int, mean_request_s: float | None) -> float:
    """Seconds until ``queued`` requests drain, ``decode_batch`` at a time, each taking
    ``mean_request_s`` (``DEFAULT_REQUEST_S`` before any finished); 0 when none wait."""
    if queued == 0:
        return 0.0
    per_request = mean_request_s or DEFAULT_REQUEST_S
    return per_request * -(-queued // decode_batch)


def retry_after_s(eta_s: float) -> int:
    """The Retry-After seconds for a refused request: the drain time, rounded, within
    ``RETRY_AFTER_RANGE``."""
    low, high = RETRY_AFTER_RANGE
    return min(max(round(eta_s), low), high)


SHORT_PROMPTS = (96, 192)  # warm-up prompt lengths, one in each of fast_linear's short-prefill buckets


def warm_up_prefills(step: int, context: int, vocab_size: int,
                     eos_ids: Iterable[int]) -> list[list[GenerateRequest]]:
    """The prefill shapes a model's traffic uses, as rounds of requests to run one
    round after the other: a prompt of a whole prefill chunk and a remainder, alone
    (the chunk a step takes while nothing decodes); the same prompt again (a
    prompt-cache hit: the cached prefix merged into the batch); another such prompt
    arriving beside a decoding request (the smaller chunk of ``prefill_step`` while
    streams decode); and short prompts of ``SHORT_PROMPTS`` tokens, one at a time (on
    CUDA a product of 65-128 rows and one of 129-256 may each take a path of its own).
    Fits the context window."""
    no_eos = {t: -100.0 for t in eos_ids}
    greedy = SamplingParams(temperature=0.0, logit_bias=no_eos)
    length = max(2, min(step + 17, context // 2 - 8))

    def prompt(seed: int, n: int) -> tuple[int, ...]:
        return tuple((seed * 131 + 7 * j + 3) % vocab_size for j in range(n))

    def request(name: str, tokens: tuple[int, ...], max_tokens: int) -> GenerateRequest:
        return GenerateRequest(tokens, max_tokens=max_tokens, sampling=greedy, id=f"req-warmup-{name}")

    long = prompt(1, length)
    shared_steps = -(-length // prefill_step(step, decoding=1, waiting=1)) + 4
    return [
        [request("prefill", long, 2)],
        [request("prefix-hit", long, 2)],
        [request("decoding", prompt(2, 8), shared_steps), request("shared-prefill", prompt(3, length), 2)],
        *([request(f"short-{n}", prompt(4 + n, n), 2)] for n in SHORT_PROMPTS if n < length),
    ]


def warm_up_requests(width: int, vocab_size: int, eos_ids: Iterable[int]) -> list[GenerateRequest]:
    """``width`` short requests that, submitted together, take a batch through every
    width from ``width`` down to 1: each decodes past the admission of the last
    (however many prompts prefill together) and each asks for one token more than the
    one before, so they leave one by one. Greedy, with the end-of-sequence tokens
    banned: none may leave early."""
    no_eos = {t: -100.0 for t in eos_ids}
    greedy = SamplingParams(temperature=0.0, logit_bias=no_eos)
    return [
        GenerateRequest(
            tuple((97 * i + 31 * j + 1) % vocab_size for j in range(8)),
            max_tokens=2 * width + 2 + i,
            sampling=greedy,
            id=f"req-warmup-{i}",
        )
        for i in range(width)
    ]
