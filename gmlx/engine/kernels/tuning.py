"""What the load-time tuner decided, kept on disk per machine, so it runs once.

Timing every decode-sized path of a model compiles and runs dozens of kernels (minutes
for an 8B on the H200, most of it compiling); the answers depend only on the GPU, MLX's
version, the activation dtype and the layer's shape (per layer) or the model's set of
layer shapes (the whole-step confirmation), so they are kept in
``cache_dir()/kernels/tuning.json`` beside MLX's compiled kernels (``gmlx cache clear
--all`` removes both). A missing, unreadable or foreign file is simply tuned again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gmlx import paths

FORMAT = 14  # 2: the tensor-core kernel, launch shapes of any length; 3: prefill buckets 128, 256;
# 4: the one-row kernel (qgemv_cuda); 5: both kernels bound per layer, 4/8-bit codes by byte permutes;
# 6: the whole step confirmed pipelined, as the worker runs it; 7: the CUDA-core kernel at 2-8 rows;
# 8: its 4/6-bit codes as 0.5 + q/256 (an instruction fewer), x once a chunk at 2-8 rows, glu_cuda;
# 9: whole steps timed without-with-with-without and MLX's product timed first and last
# (a machine warming up while timed favoured what was timed later); 10: the wide-load
# tensor-core kernel (qmmw_cuda), products timed over the weights of every layer alike
# (one layer's repeated stayed in the L2 cache); 11: whole steps timed over the worker's batch
# cache, with the blocks compiled where they are (a custom kernel's host cost is then paid at a
# trace, not every step); 12: the one-row kernel at depth 2 (two chunks a lane in flight); 13: the
# one-row kernels with x staged in shared memory, and the step kernels' launch shapes timed at one row;
# 14: the products timed as a queue again by default (a chain's under keys of their own)
Paths = dict[int, tuple[str, tuple[int, ...]]]  # row bucket -> (path, launch shape)


def machine() -> str:
    """The GPU and MLX this tuning is for: MLX's version, the architecture and the
    device's name. Cards of one architecture differ in what is fastest (an H100 and an
    H200 are both ``sm_90``, with 3.35 and 4.8 TB/s), so a tuning made on one is not
    taken on the other."""
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - a backend without device information
        info = {}
    name = info.get("device_name")
    return f"mlx-{mx.__version__}/{info.get('architecture', 'unknown')}" + (f"/{name}" if name else "")


def layer_key(dtype: Any, k: int, n: int, bits: int, group: int) -> str:
    return f"{dtype}:{k}x{n}:{bits}/{group}"


def model_key(layer_keys: Iterable[str], form: str = "") -> str:
    """The model's set of layer shapes (with their counts), as one short key; with a
    ``form`` (``traces.step_form``: its blocks compiled, or its whole step), for its
    steps in that form (a whole step's timing, and so the decision, differs)."""
    text = "\n".join(sorted(layer_keys))
    return "model:" + hashlib.sha256(text.encode()).hexdigest()[:16] + (f":{form}" if form else "")


def file_in(cache: Path) -> Path:
    """Where a cache folder (:func:`gmlx.paths.cache_dir`) keeps the tuning."""
    return cache / "kernels" / "tuning.json"


def made_for(data: Any, here: str) -> bool:
    """Whether a tuning file's contents are of this format and of the machine ``here``
    (:func:`machine`)."""
    return isinstance(data, dict) and data.get("format") == FORMAT and data.get("machine") == here


class Tuning:
    """The tuner's decisions for this machine: read once, written back when they grew."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or file_in(paths.cache_dir())
        self.machine = machine()
        self._data: dict[str, Any] = {}
        self._dirty = False
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if made_for(data, self.machine):
                self._data = data.get("entries", {})

    def layer(self, key: str) -> Paths | None:
        entry = self._data.get(key)
        if not isinstance(entry, dict):
            return None
        return {int(rows): (p, tuple(int(v) for v in c)) for rows, (p, c) in entry.items()}

    def set_layer(self, key: str, chosen: Paths) -> None:
        self._data[key] = {str(rows): [p, list(c)] for rows, (p, c) in chosen.items()}
        self._dirty = True

    def confirmed(self, key: str) -> dict[int, float] | None:
        entry = self._data.get(key)
        return {int(r): float(x) for r, x in entry.items()} if isinstance(entry, dict) else None

    def set_confirmed(self, key: str, confirmed: dict[int, float]) -> None:
        self._data[key] = {str(r): x for r, x in confirmed.items()}
        self._dirty = True

    def save(self) -> None:
        """Write the file if anything was added (a temp file, then a rename: a reader
        never sees half of it). A failure to write only costs a re-tune next time."""
        if not self._dirty:
            return
        body = {"format": FORMAT, "machine": self.machine, "entries": self._data}
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
            self._dirty = False
