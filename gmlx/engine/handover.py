"""Handing a forward pass to the device in chunks of layers, on a second thread, while
the stepping thread builds the next chunk.

On a GPU a decode step of a few streams is bound by the host: on the H200 an 8B's
one-stream step took ~6.3 ms, of which ~2.3 building its graph in Python and ~3.9
handing its ~870 operations to MLX (``mx.async_eval``), one after the other, while the
GPU needed about 3. MLX lets go of the GIL while it hands a graph over, so the two can
overlap: after every ``every`` layers the layer's output is handed over on a second
thread (which evaluates that much of the graph, the layers' cache writes included) while
this thread builds the following layers. The forward pass waits for the last hand-over
before it returns, so whatever the caller evaluates next (the step's own
``async_eval``, a read of its tokens) never meets a hand-over in flight: the two threads
only ever overlap building with evaluating, never evaluating with evaluating.

Arrays MLX evaluates on another thread must live on a stream any thread may use
(``mx.new_thread_unsafe_stream``); the hand-over happens only for a forward pass that
runs on the stream :func:`attach` made (the generator's), and every other call of the
model (warm-up, the tuner, a drafter on its own stream) runs as it always did.

A layer that reads an array on the host in the middle of a forward pass (a mask built
inside the layer loop from a cache's padding not yet evaluated) would evaluate while a
hand-over may be in flight; mlx-lm's llama-family models build their masks before the
loop, and gmlx's batch cache keeps its padding evaluated, but this is one reason more the
setting stays opt-in.

Off unless ``GMLX_HANDOVER_LAYERS`` names the layers per chunk (e.g. 8). Measured on the
H200 (``benchmarks/gpu/pipeline_check.py``, an 8B, 2026-12-03 13:45): with Q4_K_M's
layouts one stream's step took 6.0-6.2 ms in chunks of 4 or 8 layers against 6.2-6.4
handed over whole, in bf16 5.1-5.6 against 4.7, and at 8 streams 10.5 against 6.6-10.3:
the overlap happens (handing over fell from ~4 ms to ~1) but the graph building slowed
by about as much (1.3-1.7 ms to 4.5-4.7), the two threads taking turns at the GIL and at
MLX's own locks. Not worth turning on as it is.
"""

from __future__ import annotations

import os
import queue
import threading
from functools import cache
from typing import Any

from gmlx.engine.kernels import swaps

ENV = "GMLX_HANDOVER_LAYERS"


def layers_per_chunk() -> int:
    """``GMLX_HANDOVER_LAYERS`` as a count of layers; 0 (off) when unset or not a
    positive number."""
    try:
        return max(0, int(os.environ.get(ENV, "0")))
    except ValueError:
        return 0


class HandOver:
    """The second thread: evaluates (``mx.async_eval``) what it is handed, in order."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.handed = 0  # chunks handed over (what the tests read)
        self._todo: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gmlx-hand-over", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import mlx.core as mx

        while True:
            arrays = self._todo.get()
            try:
                if arrays is None:
                    return
                if self._error is None:
                    with mx.stream(self.stream):
                        mx.async_eval(arrays)
            except BaseException as e:  # noqa: BLE001 - raised again on the stepping thread
                self._error = e
            finally:
                self._todo.task_done()

    def hand(self, arrays: Any) -> None:
        self.handed += 1
        self._todo.put(arrays)

    def join(self) -> None:
        """Wait until everything handed over is; raises what a hand-over raised."""
        self._todo.join()
        if (error := self._error) is not None:
            self._error = None
            raise error

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()


def attach(model: Any, every: int) -> HandOver:
    """Make ``model``'s forward passes on the returned hand-over's stream hand every
    ``every`` layers' output to its thread; :func:`detach` undoes it. The model's
    parameter tree is unchanged (its layers change class, not place)."""
    import mlx.core as mx

    stream = mx.new_thread_unsafe_stream(mx.default_device())
    handover = HandOver(stream)
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if (i + 1) % every == 0 and i + 1 < len(layers):  # the last chunk: the caller's own hand-over
            object.__setattr__(layer, "_gmlx_handover", handover)
            layer.__class__ = _handing(type(layer))
    object.__setattr__(model, "_gmlx_handover", handover)
    model.__class__ = _joining(type(model))
    return handover


def detach(model: Any) -> None:
    """Undo :func:`attach` and stop its thread (after what it was handed)."""
    handover = model.__dict__.get("_gmlx_handover")
    if handover is None:
        return
    swaps.restore(model, "handover")
    for m in [model, *_layers(model)]:
        if "_gmlx_handover" in m.__dict__:
            object.__delattr__(m, "_gmlx_handover")
    handover.close()


def _layers(model: Any) -> list[Any]:
    """mlx-lm's ``model.layers``; none for a model without them (nothing hands over)."""
    return list(getattr(model, "layers", None) or [])


def _on_stream(handover: HandOver) -> bool:
    import mlx.core as mx

    return mx.default_stream(mx.default_device()) == handover.stream


@cache
def _handing(cls: type) -> type:
    """``cls`` whose call hands its output over when it runs on the hand-over's stream."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = cls.__call__(self, *args, **kwargs)
        handover = self._gmlx_handover
        if _on_stream(handover):
            handover.hand(out)
        return out

    return swaps.subclass(cls, "handover", __call__)


@cache
def _joining(cls: type) -> type:
    """``cls`` whose call returns only after its layers' hand-overs are done."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handover = self._gmlx_handover
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            handover.join()

    return swaps.subclass(cls, "handover", __call__)
