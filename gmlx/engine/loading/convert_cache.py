"""A disk cache of converted GGUF weights, so a GGUF file converts once, not on every load.

Converting a GGUF (K-quants unpacked and repacked into MLX's affine layout, some
requantized) takes minutes for an 8B model. The first load saves the converted arrays
as ``<key>.safetensors`` under ``cache_dir()/converted``, with the quantization modes
and load notes in the safetensors metadata; the built tokenizer as ``<key>.tokenizer``
(``tokenizer_blob``); and a ``<key>.json`` sidecar (source, bytes, the tokenizer's size
and sha256; last use) that marks the entry complete. Later loads ``mx.load`` the weights
and read the tokenizer back instead of converting and rebuilding.

The key is the GGUF's identity (resolved path, size, mtime_ns, sha256 of its header and
tensor table), the float dtype and :func:`converter_version`. The cache is bounded by
``GMLX_CONVERT_CACHE_BYTES`` (default 64 GiB, 0 disables), least recently used entries
go first, and an entry is only written when it fits the free disk. Writes go to a temp
name and ``os.replace``; a per-key ``flock`` makes a second process wait for the first
conversion instead of repeating it. A corrupt or partial entry (weights or tokenizer) is
rebuilt with one warning.

The first load does not wait for its entry to be written: the model is ready as soon as
it is converted, and the entry is written on a thread of its own (which holds the key's
lock until it is done, so another load of the file waits for the entry rather than
converting again). The tokenizer's serialization and the write were ~0.8 s of a ~2.4 s
first load of a 150k-vocabulary test GGUF here; an 8B's entry is 4.6 GB. The lock and
the writer threads are ``write_behind``'s; ``wait_for_writes`` (imported here too) waits
for them, as the interpreter does at exit.

:func:`keep_compiled_kernels` points MLX's own disk cache of compiled CUDA kernels at
gmlx's cache dir, so it outlives the system temp dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import tokenizers

from gmlx import paths
from gmlx.engine.loading import progress, tokenizer_blob
from gmlx.engine.loading.gguf_file import GGUFFile
from gmlx.engine.loading.gguf_tokenizer import TokenizerSpec
from gmlx.engine.loading.write_behind import FileLock, wait_for_writes, write_behind

log = logging.getLogger(__name__)

# Bump when the cache's own format changes; edits to the converter modules are covered
# by the hash of their source (see converter_version).
FORMAT_VERSION = 2  # 2: the tokenizer is part of the entry
DEFAULT_MAX_BYTES = 64 << 30
ENV_MAX_BYTES = "GMLX_CONVERT_CACHE_BYTES"
_CONVERTER_MODULES = (
    "gguf.py",
    "gguf_quant.py",
    "gguf_arch.py",
    "gguf_tokenizer.py",
    "tokenizer_blob.py",
)
_TOKENIZER = ".tokenizer"  # not .json: the sidecars are the *.json files
# MLX's disk cache of NVRTC-compiled kernels (mlx/backend/cuda/jit_module.cpp,
# ptx_cache_dir(); default <temp dir>/mlx/<version>/ptx, read at the first JIT compile).
ENV_KERNEL_CACHE = "MLX_PTX_CACHE_DIR"
_META_KEY = "gmlx_converted"
_DISK_MARGIN = 1 << 30  # leave this much disk free after writing an entry
_STALE_TEMP_S = 3600.0


@dataclass
class Converted:
    """What a GGUF conversion yields: mlx-lm parameters (before the model's ``sanitize``,
    which runs on every load), the quantized modules' ``(group_size, bits)`` by module
    path, and the load notes."""

    weights: dict[str, mx.array]
    modes: dict[str, tuple[int, int]]
    notes: list[str]
    tokenizer: TokenizerSpec | None = None


@dataclass(frozen=True)
class Entry:
    """One cache entry, as its sidecar describes it."""

    key: str
    source: str
    bytes: int
    last_used: float
    path: Path


def cache_root() -> Path:
    return paths.cache_dir() / "converted"


def max_bytes() -> int:
    """``$GMLX_CONVERT_CACHE_BYTES`` (plain bytes or with a K/M/G/T suffix), else 64 GiB."""
    raw = os.environ.get(ENV_MAX_BYTES, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(raw[-1].upper(), 1)
    try:
        return max(0, int(float(raw[:-1] if scale > 1 else raw) * scale))
    except ValueError:
        log.warning("%s=%r is not a byte count; using the default 64 GiB", ENV_MAX_BYTES, raw)
        return DEFAULT_MAX_BYTES


def converter_version() -> str:
    """FORMAT_VERSION, the MLX and ``tokenizers`` versions and a hash of the converter
    modules' source (the tokenizer builder's included).

    A source hash rather than a hand-bumped constant: a forgotten bump would silently
    serve weights from old conversion code, while a needless re-conversion after an
    upgrade only costs one slow load.
    """
    h = hashlib.sha256(f"{FORMAT_VERSION}:{mx.__version__}:{tokenizers.__version__}".encode())
    here = Path(__file__).resolve().parent
    for name in _CONVERTER_MODULES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def entry_key(f: GGUFFile, dtype: mx.Dtype) -> str:
    """The cache key of a GGUF file converted to ``dtype`` by this converter."""
    path = f.path.resolve()
    st = path.stat()
    identity = {
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "header": hashlib.sha256(f.header()).hexdigest(),
        "dtype": str(dtype),
        "converter": converter_version(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def load_or_convert(
    f: GGUFFile,
    dtype: mx.Dtype,
    convert: Callable[[], Converted],
    tokenizer: Callable[[], TokenizerSpec],
) -> Converted:
    """The converted weights and the tokenizer spec of ``f``: from the cache when a valid
    entry exists, else from ``tokenizer()`` and ``convert()`` (then stored). Either way
    one note says where they came from."""
    limit = max_bytes()
    if limit == 0:
        return _build(convert, tokenizer)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = entry_key(f, dtype)
    lock = FileLock(root / f"{key}.lock")
    try:
        cached = _read(root, key)
        if cached is not None:
            lock.release()
            cached.notes.append(f"converted weights: from cache {root / key}.safetensors")
            return cached
        converted = _build(convert, tokenizer)
        write, note = _plan_store(root, key, f.path.resolve(), converted, limit)
    except BaseException:
        lock.release()
        raise
    converted.notes.append(note)
    if write is None:
        lock.release()
    else:
        write_behind(write, lock)
    return converted


def keep_compiled_kernels() -> Path | None:
    """On CUDA, point MLX's disk cache of compiled kernels (``MLX_PTX_CACHE_DIR``) at
    ``cache_dir()/kernels/mlx-<version>/<GPU architecture>``, unless it is set already.

    MLX compiles many CUDA kernels with NVRTC at their first use and keeps the result in
    that folder, by default under the system temp dir (often wiped at reboot); a version
    and architecture of its own per folder, as a shared home may see other GPUs. CPU and
    Metal have no such cache to point (the CPU backend's compiled kernels stay under the
    temp dir; Metal keeps its pipelines in memory). Returns the folder set, or None.
    """
    cuda = getattr(mx, "cuda", None)
    if os.environ.get(ENV_KERNEL_CACHE) or cuda is None or not cuda.is_available():
        return None
    arch = str(mx.device_info().get("architecture", "unknown"))
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in arch)
    folder = paths.cache_dir() / "kernels" / f"mlx-{mx.__version__}" / safe
    os.environ[ENV_KERNEL_CACHE] = str(folder)
    return folder


def clear_kernels() -> int:
    """Remove gmlx's folder of MLX's compiled CUDA kernels (:func:`keep_compiled_kernels`);
    returns the bytes it held (they compile again at their next first use)."""
    import shutil

    folder = paths.cache_dir() / "kernels"
    if not folder.is_dir():
        return 0
    freed = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return freed


def entries() -> list[Entry]:
    """Every complete entry, most recently used first (after this process's pending
    writes: see :func:`wait_for_writes`)."""
    wait_for_writes()
    root = cache_root()
    found = []
    for sidecar in root.glob("*.json") if root.is_dir() else []:
        try:
            info = json.loads(sidecar.read_text())
            found.append(
                Entry(
                    key=sidecar.stem,
                    source=str(info["source"]),
                    bytes=int(info["bytes"]) + int(info.get("tokenizer", {}).get("bytes", 0)),
                    last_used=sidecar.stat().st_mtime,
                    path=sidecar.with_suffix(".safetensors"),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda e: e.last_used, reverse=True)


def remove(entry_key_: str) -> None:
    """Delete one entry's files (the sidecar first, so a half-removed entry is incomplete).
    Its lock file stays: another loader may hold it."""
    root = cache_root()
    for suffix in (".json", ".safetensors", _TOKENIZER):
        with contextlib.suppress(FileNotFoundError):
            (root / f"{entry_key_}{suffix}").unlink()


def clear(source: Path | None = None) -> list[Entry]:
    """Remove every entry, or those converted from ``source``; returns the removed ones.
    With no source, leftover temp files go as well."""
    wanted = None if source is None else str(source.expanduser().resolve())
    removed = [e for e in entries() if wanted is None or e.source == wanted]
    for e in removed:
        remove(e.key)
    root = cache_root()
    if source is None and root.is_dir():
        for leftover in root.iterdir():
            with contextlib.suppress(OSError):
                leftover.unlink()
    return removed


# -- reading and writing ------------------------------------------------------------------


def _build(convert: Callable[[], Converted], tokenizer: Callable[[], TokenizerSpec]) -> Converted:
    spec = tokenizer()  # first: an unsupported tokenizer fails before a long conversion
    converted = convert()
    converted.tokenizer = spec
    return converted


def _read(root: Path, key: str) -> Converted | None:
    """A valid entry's contents, else None; an invalid entry is deleted with one warning."""
    data, sidecar = root / f"{key}.safetensors", root / f"{key}.json"
    if not data.exists() and not sidecar.exists():
        return None
    progress.phase("cached")
    try:
        info = json.loads(sidecar.read_text())
        if data.stat().st_size != int(info["bytes"]):
            raise ValueError(f"{data.stat().st_size} bytes on disk, {info['bytes']} written")
        weights, metadata = mx.load(str(data), return_metadata=True)
        meta = json.loads(metadata[_META_KEY])
        if len(weights) != int(meta["tensors"]):
            raise ValueError(f"{len(weights)} tensors, {meta['tensors']} written")
        mx.eval(list(weights.values()))  # reads every byte now, so a bad file fails here
        converted = Converted(
            weights=weights,
            modes={k: (int(g), int(b)) for k, (g, b) in meta["modes"].items()},
            notes=[str(n) for n in meta["notes"]],
            tokenizer=_read_tokenizer(root / f"{key}{_TOKENIZER}", info["tokenizer"]),
        )
    except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
        log.warning("converted-weights cache entry %s is unusable (%s); rebuilding it", data, e)
        remove(key)
        return None
    # Last use, for LRU eviction, given as this moment's time: a time the kernel picks
    # itself may be a coarse clock's (Linux's multigrain timestamps), a tick behind a
    # write it stamped finely just before, which then looks more recent than this use.
    now = time.time_ns()
    os.utime(sidecar, ns=(now, now))
    return converted


def _read_tokenizer(path: Path, info: dict[str, Any]) -> TokenizerSpec:
    data = path.read_bytes()
    if len(data) != int(info["bytes"]):
        raise ValueError(f"tokenizer: {len(data)} bytes on disk, {info['bytes']} written")
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise ValueError("tokenizer: its sha256 differs from the one written")
    return tokenizer_blob.load(data)


def _plan_store(
    root: Path, key: str, source: Path, converted: Converted, limit: int
) -> tuple[Callable[[], None] | None, str]:
    """Decide whether an entry is written (its weights fit the bound and the disk: least
    recently used entries are evicted for them now) and return the writing, to run
    later, and the load note. The writing holds its own copies of what it writes: the
    caller goes on with ``converted`` (a model's ``sanitize`` may change its dict of
    weights). The tokenizer is serialized by the writing (half a second for a 150k
    vocabulary), which checks the bound again with it."""
    spec = converted.tokenizer
    assert spec is not None
    need = sum(a.nbytes for a in converted.weights.values())
    if need > limit:
        log.info("converted weights (%d bytes) exceed %s; not cached", need, ENV_MAX_BYTES)
        return None, f"converted weights: not cached ({need} bytes exceed {ENV_MAX_BYTES}={limit})"
    _evict(root, limit - need, keep=key)
    free = shutil.disk_usage(root).free
    if free < need + _DISK_MARGIN:
        log.info("converted weights (%d bytes) do not fit %d free bytes; not cached", need, free)
        return None, f"converted weights: not cached (only {free} bytes free on disk)"
    meta = {"tensors": len(converted.weights), "modes": dict(converted.modes), "notes": list(converted.notes)}
    weights = dict(converted.weights)
    # evaluated here, on the loading thread: MLX evaluates an array only on a thread that
    # has its stream, and the writer has none (a model needs them evaluated anyway)
    mx.eval(list(weights.values()))
    data = root / f"{key}.safetensors"

    def write() -> None:
        tok = tokenizer_blob.dump(spec)
        if need + len(tok) > limit:
            log.info("converted weights and tokenizer (%d bytes) exceed %s; not cached", need + len(tok),
                     ENV_MAX_BYTES)
            return
        tmp = root / f"{key}.safetensors.tmp-{os.getpid()}-{threading.get_ident()}.safetensors"
        tokenizer = {"bytes": len(tok), "sha256": hashlib.sha256(tok).hexdigest()}
        try:
            mx.save_safetensors(str(tmp), weights, metadata={_META_KEY: json.dumps(meta)})
            size = tmp.stat().st_size
            os.replace(tmp, data)
            _write_bytes(root / f"{key}{_TOKENIZER}", tok)
            _write_json(
                root / f"{key}.json", {"source": str(source), "bytes": size, "tokenizer": tokenizer}
            )
        except Exception as e:  # noqa: BLE001 - a background write that fails leaves no entry
            with contextlib.suppress(OSError):
                tmp.unlink()
            remove(key)  # no part of a half-written entry stays
            log.warning("could not write the converted-weights cache entry %s: %s", data, e)
            return
        log.info("converted weights: cached in %s", data)

    return write, f"converted weights: cached in {data} (written after the load)"


def _write_json(path: Path, body: dict[str, Any]) -> None:
    _write_bytes(path, json.dumps(body).encode())


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _evict(root: Path, budget: int, keep: str) -> None:
    """Delete least recently used entries until the rest fit ``budget`` bytes, and temp
    files a crashed writer left behind."""
    now = time.time()
    for tmp in root.glob("*.tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _STALE_TEMP_S:
                tmp.unlink()
    live = [e for e in entries() if e.key != keep]
    total = sum(e.bytes for e in live)
    for e in reversed(live):  # least recently used first
        if total <= budget:
            break
        log.info("evicting converted weights of %s (%d bytes)", e.source, e.bytes)
        remove(e.key)
        total -= e.bytes
