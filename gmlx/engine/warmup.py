"""Warm-up: a model's step shapes run once before it reports ready.

On an accelerator each new shape of a step compiles its kernels on first use (up to
seconds), which would otherwise land in some client's time to first token.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gmlx.engine import scheduling
from gmlx.engine.capacity import backend
from gmlx.engine.stats import WorkerStats

log = logging.getLogger("gmlx.engine")
WARMUP_MAX_WIDTH = 32  # wider batches compile their shapes on first use


def warm_up(worker: Any, prefills: bool | None = None) -> float:
    """Run ``worker``'s (a :class:`~gmlx.engine.worker.ModelWorker`) every decode-batch
    width once, and with ``prefills`` the prefill shapes (a whole chunk alone, a
    prompt-cache hit, the smaller chunk beside a decoding stream), before the first client does: on an accelerator each new shape of a
    step compiles its kernels on first use (up to seconds), which would otherwise
    land in some client's time to first token. The model is not ready until this
    ends. ``prefills`` defaults to "on an accelerator": on the CPU a chunk-long
    prefill of a large model costs minutes and compiles little.

    ``decode_batch`` short requests (at most ``WARMUP_MAX_WIDTH``) go in together and
    leave one by one (``scheduling.warm_up_requests``), so the batch passes through
    every width down to 1. The chat template
    is rendered once first (its compilation would also land in the first client's
    time). The prompt cache and the statistics are cleared afterwards. Returns the
    seconds it took.
    """
    started = time.monotonic()
    try:  # the chat template compiles on its first render (~10 ms on a CPU)
        worker.loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello."}])
    except Exception as e:  # noqa: BLE001 - a real request will report it properly
        log.debug("%s: warm-up render failed: %r", worker.loaded.id, e)
    eos = worker.loaded.tokenizer.eos_token_ids
    ramp = scheduling.warm_up_requests(min(worker.decode_batch, WARMUP_MAX_WIDTH), worker.vocab_size, eos)
    rounds = [ramp]
    if prefills if prefills is not None else backend() != "cpu":
        rounds += scheduling.warm_up_prefills(worker.prefill_step_size, worker.loaded.context_length,
                                              worker.vocab_size, eos)
    for round_ in rounds:
        for handle in [worker.submit(request) for request in round_]:
            for _ in handle:
                pass
    worker.prompt_cache.reset(stats=True)
    worker.stats = WorkerStats()
    return time.monotonic() - started
