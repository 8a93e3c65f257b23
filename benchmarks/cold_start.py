"""Cold start of a GGUF model: load (read + convert) and first-token times, with and
without a converted-weights cache entry, and optionally the same model as an MLX folder.

    python benchmarks/cold_start.py                  # a test-size Q4_K GGUF written here
    python benchmarks/cold_start.py --gguf M.gguf [--mlx DIR]

"cold" runs with an empty private cache (the conversion runs and writes the entry),
"cached" loads again from that entry. Each is one run in this process: the OS page cache
is warm for the GGUF in both, so the difference is the conversion itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _write_test_gguf(path: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gguf import GGMLQuantizationType

    from tests.engine.loading.conftest import write_tiny_model

    write_tiny_model(path, "qwen2", GGMLQuantizationType.Q4_K, seed=0)
    return path


def _first_token_s(loaded) -> float:
    import mlx.core as mx

    ids = mx.array([loaded.tokenizer.encode("Hello, world.")])
    t = time.perf_counter()
    mx.eval(loaded.model(ids)[:, -1, :].argmax(-1))
    return time.perf_counter() - t


def _measure(label: str, load) -> float:
    t = time.perf_counter()
    loaded = load()
    load_s = time.perf_counter() - t
    first_s = _first_token_s(loaded)
    cache = next((n for n in loaded.notes if n.startswith("converted weights:")), "")
    print(f"{label:8} load {load_s:8.3f} s  first token {first_s:7.3f} s  {cache}")
    return load_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a GGUF file (default: a test-size Q4_K model)")
    ap.add_argument("--mlx", type=Path, help="the same model as an MLX folder, for comparison")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gmlx-cold-start-"))
    os.environ["GMLX_CACHE_DIR"] = str(work / "cache")  # a private, empty cache
    os.environ.pop("GMLX_CONVERT_CACHE_BYTES", None)
    gguf_path = args.gguf or _write_test_gguf(work / "test-qwen2-Q4_K.gguf")

    from gmlx.engine.loading import gguf, load_model

    try:
        print(f"{gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
        cold = _measure("cold", lambda: gguf.load(gguf_path))
        cached = _measure("cached", lambda: gguf.load(gguf_path))
        print(f"cached/cold load time: {cached / cold:.3f}")
        if args.mlx:
            _measure("mlx", lambda: load_model(str(args.mlx)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
