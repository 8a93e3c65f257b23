"""A scripted :class:`~gmlx.tui.source.MetricsSource`: each poll answers the next
scripted step (the last one repeats), at fixed clock times, so a test reads as a
story and a snapshot is the same every run."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from gmlx.tui.source import ActionResult, Poll, SourceError, Trouble

START = datetime(2025, 1, 2, 9, 30, 0)

DOWN = SourceError(
    Trouble.UNREACHABLE, "Cannot reach a gmlx server at http://gmlx.test: connection refused."
)
KEY_REFUSED = SourceError(
    Trouble.UNAUTHORIZED,
    "The server refused the key (401): pass its key with --api-key or GMLX_API_KEY.",
)


def request(rid: str, model: str, state: str, **fields: Any) -> dict[str, Any]:
    row = {
        "id": rid,
        "model": model,
        "state": state,
        "position": None,
        "prompt_tokens": 100,
        "generated": 0,
        "max_tokens": 512,
        "elapsed_s": 1.0,
        "ttft_s": None,
        "decode_tok_s": None,
        "cache": None,
        "speculative": None,
    }
    return {**row, **fields}


def metrics(requests: Iterable[dict[str, Any]] = (), **over: Any) -> dict[str, Any]:
    """A ``/v1/metrics`` document shaped as gmlx's: two resident models, a green
    governor on a 32 GiB machine; ``over`` replaces whole sections."""
    gib = 1024**3
    reqs = list(requests)
    running = [r for r in reqs if r["state"] != "queued"]
    server: dict[str, Any] = {
        "pid": 4242,
        "uptime_s": 3725.4,
        "concurrency": {
            "decode_batch": 8,
            "queue_cap": 32,
            "in_flight": len(running),
            "waiting": len(reqs) - len(running),
        },
        "queue": {
            "waiting": len(reqs) - len(running),
            "cap": 32,
            "eta_s": 4.5 if len(reqs) > len(running) else 0.0,
            "rejections": 3,
            "last_reject_reason": None,
        },
        "requests": reqs,
        "resident_models": [
            {
                "id": "qwen",
                "in_flight": sum(r["model"] == "qwen" for r in running),
                "waiting": 0,
                "decode_batch": 8,
                "pinned": True,
                "kept": False,
                "weight_bytes": 5 * gib,
                "prompt_cache_bytes": 300 * 1024**2,
                "profile": None,
            },
            {
                "id": "demo",
                "in_flight": sum(r["model"] == "demo" for r in running),
                "waiting": 0,
                "decode_batch": 8,
                "pinned": False,
                "kept": True,
                "weight_bytes": 1919488,
                "prompt_cache_bytes": 0,
                "profile": "chat",
            },
        ],
        "governor": {
            "enabled": True,
            "band": "green",
            "headroom_bytes": 20 * gib,
            "floor_bytes": 2 * gib,
            "sheds": 1,
            "band_changes": 2,
            "entered": {},
            "admission_paused": False,
        },
        "memory": {
            "active_bytes": 6 * gib,
            "cache_bytes": 2 * gib,
            "peak_bytes": 9 * gib,
            "headroom_bytes": 20 * gib,
            "total_bytes": 32 * gib,
        },
        "capacity": None,
        "rates": {
            "decode_tok_s": 84.5,
            "decode_streams": len(running),
            "prefill_tok_s_recent": 950.0,
            "decode_tok_s_recent": 41.2,
            "decode_tok_s_lifetime": 39.9,
        },
    }
    server.update(over)
    return {"server": server}


MODELS = (
    {"id": "qwen", "default": True, "context_length": 32768, "max_context_at_width_1": 32768},
    {"id": "demo", "default": False, "context_length": 8192, "max_context_at_width_1": 8192},
)

BUSY = metrics(
    [
        request("req-a1c0de", "qwen", "queued", position=1, prompt_tokens=4000, elapsed_s=2.0),
        request(
            "req-b2e4f1",
            "qwen",
            "decode",
            prompt_tokens=1200,
            generated=300,
            max_tokens=2048,
            elapsed_s=12.3,
            ttft_s=0.42,
            decode_tok_s=38.5,
            cache={"tier": "block", "warm_tokens": 1024},
        ),
        request("req-c3d9a7", "demo", "prefill", prompt_tokens=9000, elapsed_s=0.8),
        request(
            "req-d4f2b8",
            "demo",
            "decode",
            prompt_tokens=50,
            generated=900,
            max_tokens=1000,
            elapsed_s=75.0,
            ttft_s=0.05,
            decode_tok_s=120.25,
            cache={"tier": "miss", "warm_tokens": 0},
        ),
    ]
)


class ScriptedSource:
    """Answers ``steps`` in order (a metrics document, or a SourceError), a second
    apart from START; records the actions it was asked for."""

    url = "http://gmlx.test"

    def __init__(
        self,
        steps: Iterable[dict[str, Any] | SourceError],
        models: tuple[dict[str, Any], ...] = MODELS,
    ) -> None:
        self.steps = list(steps)
        self.models = models
        self.polls = 0
        self.actions: list[tuple[str, ...]] = []

    async def poll(self) -> Poll:
        step = self.steps[min(self.polls, len(self.steps) - 1)]
        at = START + timedelta(seconds=self.polls)
        self.polls += 1
        if isinstance(step, SourceError):
            return Poll(at=at, error=step)
        return Poll(at=at, metrics=copy.deepcopy(step), models=self.models)

    async def cancel(self, request_id: str) -> ActionResult:
        self.actions.append(("cancel", request_id))
        return ActionResult(True, f"cancelled {request_id}")

    async def unload(self, model: str) -> ActionResult:
        self.actions.append(("unload", model))
        return ActionResult(True, f"unloaded {model}")

    async def keep(self, model: str, keep: bool) -> ActionResult:
        self.actions.append(("keep" if keep else "release", model))
        return ActionResult(True, f"kept {model}")

    async def close(self) -> None:
        pass
