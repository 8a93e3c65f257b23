"""A worker's rates and counters, and the log-probabilities its events carry."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

from gmlx.engine.types import FinishReason, GenerateRequest

RECENT = 8  # requests averaged in the "recent" rates


def token_logprobs(token: int, row: Any, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` in ``row`` (a step's log-probabilities over the
    vocabulary, already evaluated) and the ``top`` most likely tokens, most likely first."""
    import mlx.core as mx

    chosen = row[token].item()
    k = min(top, row.shape[-1])
    if k <= 0:
        return chosen, ()
    ids = mx.argpartition(-row, k - 1)[:k]
    values = row[ids]
    pairs = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: -p[1])
    return chosen, tuple(pairs)


class FinishedRequest(Protocol):
    """What the statistics read of a finished request (an ``ActiveRequest``)."""

    generated: int
    warm_tokens: int
    submitted_at: float
    admitted_at: float | None
    first_token_at: float | None

    @property
    def request(self) -> GenerateRequest: ...


class WorkerStats:
    """Rates and counters of one worker, written by its thread, read by any."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests_finished = 0
        self.rejections = 0
        self.last_reject_reason: str | None = None
        self.finish_reasons: dict[str, int] = {}
        self._recent: deque[tuple[float, float | None, float | None]] = deque(maxlen=RECENT)
        self._steps: deque[tuple[float, int]] = deque(maxlen=256)
        self._decode_tokens = 0
        self._decode_s = 0.0

    def note_step(self, tokens: int) -> None:
        if tokens:
            self._steps.append((time.monotonic(), tokens))

    def record(self, active: FinishedRequest, reason: FinishReason) -> None:
        now = time.monotonic()
        self.requests_finished += 1
        self.finish_reasons[reason.value] = self.finish_reasons.get(reason.value, 0) + 1
        if active.admitted_at is None:
            return
        prefill = decode = None
        if active.first_token_at is not None:
            cold = len(active.request.prompt_tokens) - active.warm_tokens
            prefill_s = active.first_token_at - active.admitted_at
            prefill = cold / prefill_s if prefill_s > 0 else None
            decode_s = now - active.first_token_at
            if active.generated > 1 and decode_s > 0:
                decode = (active.generated - 1) / decode_s
                self._decode_tokens += active.generated - 1
                self._decode_s += decode_s
        self._recent.append((now - active.submitted_at, prefill, decode))

    def mean_request_s(self) -> float | None:
        durations = [d for d, _, _ in list(self._recent)]
        return sum(durations) / len(durations) if durations else None

    def rates(self, window_s: float = 2.0) -> dict[str, Any]:
        now = time.monotonic()
        steps = [(t, n) for t, n in list(self._steps) if now - t <= window_s]
        recent = list(self._recent)

        def mean(values: list[float | None]) -> float | None:
            vals = [v for v in values if v is not None]
            return round(sum(vals) / len(vals), 2) if vals else None

        return {
            "decode_tok_s": round(sum(n for _, n in steps) / window_s, 2) if steps else 0.0,
            "decode_streams": max((n for _, n in steps[-4:]), default=0),
            "prefill_tok_s_recent": mean([p for _, p, _ in recent]),
            "decode_tok_s_recent": mean([d for _, _, d in recent]),
            "decode_tok_s_lifetime": round(self._decode_tokens / self._decode_s, 2) if self._decode_s else None,
        }
