"""Where a served decode step's host time goes: ``GMLX_STEP_TIMES=N`` logs, every ``N``
decode steps of one width, the medians of each phase of the worker's step.

Why: on an H100 (8B Q4_K_M, one stream, 12-06 evening) the served step took 4.29 ms a
token while the same model's step in a bare pipelined loop (``kernel_times.py --loops
served``: build, hand over, read the previous token) took 3.40 and kept the GPU busy
3.27 ms of it. A pipelined step hides the host's work behind the GPU's only while that
work is shorter than the GPU's; the phases say which part of the served loop is not.

The phases of one decode step (:func:`gmlx.engine.mlxlm._decode_batch`'s ``_step``),
each a ``time.perf_counter`` stamp, and what lies between two steps:

- ``build``: the step's graph built in Python (the model's call, the processors, the
  log-probabilities and the sampler);
- ``hand``: ``mx.async_eval`` handing it to the device (on CUDA: MLX encoding each
  kernel, its graph replayed or captured);
- ``wait``: waiting for the previous step's tokens (the device still busy: the host is
  ahead, which is where a served step should spend its slack);
- ``read``: those tokens read to Python;
- ``between``: from the end of one step to the start of the next (mlx-lm's and gmlx's
  handling of the tokens: stop checks, detokenizing, handing each to its request, the
  worker's loop).

Each line also gives the steps' mean and longest period (a stall once a request, a
trace or a collection, hides in the medians but not in the mean) and the cyclic garbage
collector's passes while the steps ran (``gc.callbacks``: how many of each generation,
and their time; not those of a load or of an idle worker).

Off by default: the stamps are taken every step (four clock reads, well under a
microsecond) and handed on only when asked for. The log line is at INFO, under this module's
logger (``gmlx serve``'s log)."""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time

log = logging.getLogger(__name__)

ENV = "GMLX_STEP_TIMES"
PHASES = ("build", "hand", "wait", "read", "between")


def from_env() -> StepTimes | None:
    """A recorder when ``GMLX_STEP_TIMES`` names a whole number of steps above 0, else None."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        every = int(value)
    except ValueError:
        log.warning("%s=%r is not a whole number of steps; step times stay off", ENV, value)
        return None
    return StepTimes(every) if every > 0 else None


class StepTimes:
    """Stamps of decode steps, summarised every ``every`` steps of one width."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.width = 0
        self._last_end: float | None = None
        self._rows: list[tuple[float, ...]] = []  # per step: the period and each phase, in seconds
        self.summaries: list[str] = []  # every line logged (tests and benchmarks read them)
        self._collections = [[0, 0.0], [0, 0.0], [0, 0.0]]  # per generation: passes, seconds
        self._collecting = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        # counted while steps run back to back only (not a load's collection, nor an idle one)
        if phase == "start":
            self._collecting = time.perf_counter()
        elif self._last_end is not None:
            passes = self._collections[info["generation"]]
            passes[0] += 1
            passes[1] += time.perf_counter() - self._collecting

    def close(self) -> None:
        """Stop counting the collector's passes."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def note(self, width: int, begin: float, built: float, handed: float, waited: float, read: float) -> None:
        """One decode step of ``width`` rows: its five stamps (``time.perf_counter``)."""
        if width != self.width:  # a new width starts a new count; the gap before it is not a step's
            self._flush()
            self.width, self._last_end = width, None
        between = 0.0 if self._last_end is None else begin - self._last_end
        if self._last_end is not None:
            self._rows.append((read - self._last_end, built - begin, handed - built, waited - handed,
                               read - waited, between))
        self._last_end = read
        if len(self._rows) >= self.every:
            self._flush()

    def pause(self) -> None:
        """The worker went idle: the next step's gap is not a step's."""
        self._last_end = None

    def _flush(self) -> None:
        if not self._rows:
            return
        medians = [statistics.median(column) * 1e3 for column in zip(*self._rows, strict=True)]
        periods = sorted(row[0] for row in self._rows)
        p90 = periods[min(len(periods) - 1, int(0.9 * len(periods)))] * 1e3
        mean = statistics.fmean(periods) * 1e3
        phases = ", ".join(f"{name} {ms:.3f}" for name, ms in zip(PHASES, medians[1:], strict=True))
        passes = ", ".join(f"{n} of generation {g} ({s * 1e3:.1f} ms)" for g, (n, s) in enumerate(self._collections) if n)
        line = (f"decode steps of {self.width} row(s), the last {len(self._rows)}: {medians[0]:.3f} ms a step "
                f"(p90 {p90:.3f}, mean {mean:.3f}, longest {periods[-1] * 1e3:.3f}); medians in ms: {phases}; "
                f"collector passes: {passes or 'none'}")
        self._collections = [[0, 0.0], [0, 0.0], [0, 0.0]]
        self.summaries.append(line)
        log.info(line)
        self._rows.clear()
