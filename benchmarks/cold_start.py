"""Cold start of a GGUF model: load time by phase and first-token time, without the
converted-weights cache, with an empty one and from its entry, and optionally the same
model as an MLX folder.

    python benchmarks/cold_start.py                  # a test-size Q4_K GGUF written here
    python benchmarks/cold_start.py --gguf M.gguf [--mlx DIR] [--repeat N]
    python benchmarks/cold_start.py --processes       # first token, kernel caches cold/warm
    python benchmarks/cold_start.py --vocab qwen2 --before c9e50d1 --repeat 3
        # a Q4_K_M-like model with the real 151,936-token vocabulary; also the code of
        # commit c9e50d1 (before the cache and the faster converter)
    python benchmarks/cold_start.py --vocab llama-bpe --shape llama3-8b --keep /tmp/l8b.gguf \
        --no-uncached --cache /tmp/l8b-cache --profile cold.json
        # Llama-3-8B's shape in Q4_K_M's mix (4.6 GiB, kept for the next run), a py-spy
        # profile of its cold load, the cache entry kept for benchmarks/gpu/read_check.py

"uncached" runs with the cache off (GMLX_CONVERT_CACHE_BYTES=0): every load converts the
tensors and rebuilds the tokenizer, as loads did before the cache. "cold" starts from an
empty private cache (it converts and writes the entry), "cached" loads from that entry.
All run in this one process, so the OS page cache is warm for the GGUF throughout and the
differences are the conversion, the tokenizer build and the cache. With --repeat, each
row is the best of N loads (cold: one load, as only the first finds the cache empty).
Phases come from the loader's progress reports: read (header, metadata; the tokenizer
when it is built), then convert (tensors converted, the entry written) or cached (weights
and tokenizer read back); the model's set-up after that counts in the last phase.
The first token is a short prompt's, after what a server does to a loaded model on the
CPU backend (its quantized layers dequantized, memory permitting), so it includes MLX's
first compile of each shape.
``--before REV`` also loads the same file with the code of commit REV (a git worktree, in
a subprocess that imports first and then times ``load_model`` alone, best of N): the
load as it was before the cache and the faster converter (c9e50d1: the code when the
cold-start issue was filed).
"""

from __future__ import annotations

import argparse
import contextlib
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


# Shapes of the test GGUFs with a real vocabulary: (architecture, tokenizer pre-split,
# hidden, feed-forward, layers, heads, kv heads, attention biases).
SHAPES = {
    "tiny": ("qwen2", None, 256, 512, 2, 4, 2, True),
    "llama3-8b": ("llama", "llama-bpe", 4096, 14336, 32, 32, 8, False),
}


def _write_real_vocab_gguf(path: Path, vocab: str, shape: str = "tiny", layers: int | None = None) -> Path:
    """A Q4_K_M-like GGUF carrying the real ``vocab`` tokenizer from
    ../shared/fixtures/vocab: Q4_K everywhere but the output layer and the attn_v and
    ffn_down of the layers llama-quantize's Q4_K_M picks, which are Q6_K (as in the
    real mix: 33 Q6_K tensors at Llama-3-8B's 32 layers). ``shape`` "tiny" is hidden 256,
    2 layers (a test model whose load is dominated by what real models have: a large
    vocabulary, K-quant conversion); "llama3-8b" is that model's real shape (4.6 GiB;
    ``layers`` fewer to try it on a small machine). Random valid blocks: load time does
    not depend on the values."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFWriter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.gpu.q4_k_m_direct import more_bits
    from tests.engine.loading.conftest import random_blocks

    source = Path(vocab)  # a vocabulary GGUF's path, or its name in ../shared/fixtures/vocab
    if not source.is_file():
        source = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vocab" / f"ggml-vocab-{vocab}.gguf"
    reader = GGUFReader(source)

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    types = [int(reader.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in reader.fields["tokenizer.ggml.token_type"].data]
    arch, pre, hidden, ffn, n_layers, heads, kv_heads, biases = SHAPES[shape]
    layers = layers or n_layers
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(5e5 if arch == "llama" else 1e6)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    if arch == "llama":
        writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or vocab)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    end = next((t for t in ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>") if t in tokens), tokens[0])
    writer.add_eos_token_id(tokens.index(end))
    writer.add_bos_token_id(tokens.index(end))
    writer.add_add_bos_token(False)
    head = hidden // heads
    matrices = [("token_embd.weight", len(tokens), hidden, Q.Q4_K), ("output.weight", len(tokens), hidden, Q.Q6_K)]
    for i in range(layers):
        more = Q.Q6_K if shape == "tiny" or more_bits(i, layers) else Q.Q4_K
        matrices += [(f"blk.{i}.attn_q.weight", hidden, hidden, Q.Q4_K),
                     (f"blk.{i}.attn_k.weight", kv_heads * head, hidden, Q.Q4_K),
                     (f"blk.{i}.attn_v.weight", kv_heads * head, hidden, more),
                     (f"blk.{i}.attn_output.weight", hidden, hidden, Q.Q4_K),
                     (f"blk.{i}.ffn_gate.weight", ffn, hidden, Q.Q4_K),
                     (f"blk.{i}.ffn_up.weight", ffn, hidden, Q.Q4_K),
                     (f"blk.{i}.ffn_down.weight", hidden, ffn, more)]
        vectors = [("attn_norm.weight", hidden), ("ffn_norm.weight", hidden)]
        if biases:
            vectors += [("attn_q.bias", hidden), ("attn_k.bias", kv_heads * head), ("attn_v.bias", kv_heads * head)]
        for name, size in vectors:
            writer.add_tensor(f"blk.{i}.{name}", np.ones(size, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    # One random array per (type, shape), shared by every layer that has it: load time
    # does not depend on the values, and writing the 8B shape stays quick.
    blocks: dict[tuple, np.ndarray] = {}
    for name, rows, cols, qtype in matrices:
        if (key := (qtype, rows, cols)) not in blocks:
            blocks[key] = random_blocks(qtype, rows, cols, seed=len(blocks))
        writer.add_tensor(name, blocks[key], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _first_token_s(loaded) -> float:
    """Seconds to the first token of a short prompt, after what a server does to a
    loaded model on the CPU backend (dequantizing its quantized layers, memory
    permitting: MLX's CPU quantized products are 10-50x slower than float ones)."""
    import mlx.core as mx

    from gmlx.engine.capacity import free_bytes
    from gmlx.engine.loading.cpu_float import dequantize_for_cpu

    dequantize_for_cpu(loaded.model, free_bytes())
    ids = mx.array([loaded.tokenizer.encode("Hello, world.")])
    t = time.perf_counter()
    mx.eval(loaded.model(ids)[:, -1, :].argmax(-1))
    return time.perf_counter() - t


def _timed_load(load) -> tuple[float, dict[str, float], object]:
    """One load: total seconds, seconds per phase, and the loaded model."""
    from gmlx.engine.loading import progress

    marks: list[tuple[str, float]] = []

    def mark(_model_id: str, status) -> None:
        if not marks or marks[-1][0] != status.phase:
            marks.append((status.phase, time.perf_counter()))

    with progress.listening(mark), progress.loading("cold-start"):
        start = time.perf_counter()
        loaded = load()
        end = time.perf_counter()
    phases: dict[str, float] = {}
    for (name, t), nxt in zip(marks, [*(t for _, t in marks[1:]), None], strict=True):
        phases[name] = phases.get(name, 0.0) + ((end if nxt is None else nxt) - t)
    return end - start, phases, loaded


def _measure(label: str, load, repeat: int) -> float:
    best = None
    for _ in range(repeat):
        run = _timed_load(load)
        if best is None or run[0] < best[0]:
            best = run
    load_s, phases, loaded = best
    first_s = _first_token_s(loaded)
    shown = "  ".join(f"{k} {v:6.3f}" for k, v in phases.items())
    cache = next((n for n in loaded.notes if n.startswith("converted weights:")), "")
    cache = cache.split(" /")[0].split(" (")[0]  # "converted weights: cached in", without paths
    print(f"{label:9} load {load_s:7.3f} s  first token {first_s:6.3f} s  [{shown}]  {cache}")
    return load_s


_BEFORE = """
import sys, time
from gmlx.engine.loading import load_model
import mlx_lm  # noqa: F401  (imports are paid before the timing, as in this process)
best = None
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    load_model(sys.argv[1])
    best = min(best or 1e9, time.perf_counter() - t)
print(best)
"""


def _before(rev: str, gguf_path: Path, work: Path, repeat: int) -> float:
    """Seconds to load ``gguf_path`` with the code of commit ``rev``."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    tree = work / f"before-{rev}"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        env = {**os.environ, "PYTHONPATH": str(tree), "GMLX_CONVERT_CACHE_BYTES": "0"}
        out = subprocess.run([sys.executable, "-c", _BEFORE, str(gguf_path), str(repeat)], env=env,
                             cwd=tree, check=True, capture_output=True, text=True).stdout
        seconds = float(out.strip().splitlines()[-1])
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"{'before':9} load {seconds:7.3f} s  (commit {rev}, its own process)")
    return seconds


_FIRST_TOKEN = """
import sys, time
t0 = time.perf_counter()
import mlx.core as mx
from gmlx.engine.loading import load_model
loaded = load_model(sys.argv[1])
t1 = time.perf_counter()
ids = mx.array([loaded.tokenizer.encode("Hello, world. Tell me a story.")])
t = time.perf_counter()
mx.eval(loaded.model(ids)[:, -1, :].argmax(-1))
first = time.perf_counter() - t
t = time.perf_counter()
mx.eval(loaded.model(ids)[:, -1, :].argmax(-1))
again = time.perf_counter() - t
print(t1 - t0, first, again)
"""


def _processes(gguf_path: Path, work: Path) -> None:
    """Start-up to first token in two fresh processes sharing MLX's compiled-kernel
    caches (the CPU backend's under the temp dir, CUDA's under MLX_PTX_CACHE_DIR),
    empty before the first: what the second process saves is what the caches keep
    across processes."""
    import subprocess

    tmp, ptx = work / "proc-tmp", work / "proc-ptx"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "MLX_PTX_CACHE_DIR": str(ptx)}
    root = Path(__file__).resolve().parents[1]
    for label in ("cold caches", "warm caches"):
        out = subprocess.run([sys.executable, "-c", _FIRST_TOKEN, str(gguf_path)], env=env, cwd=root,
                             check=True, capture_output=True, text=True).stdout
        start, first, again = (float(v) for v in out.split()[-3:])
        print(f"process, {label}: imports + load {start:6.3f} s  first token {first:6.3f} s  "
              f"(the same prompt again {again:6.3f} s)")


@contextlib.contextmanager
def _profiled(out: Path | None):
    """py-spy sampling this process (all threads, native frames off) into ``out``, a
    speedscope JSON file, while the block runs; nothing when ``out`` is None."""
    if out is None:
        yield
        return
    import signal
    import subprocess

    spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--idle", "--rate", "200",
                            "--format", "speedscope", "-o", str(out)], stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a GGUF file (default: a test-size Q4_K model)")
    ap.add_argument("--mlx", type=Path, help="the same model as an MLX folder, for comparison")
    ap.add_argument("--repeat", type=int, default=1, help="best of N loads per row")
    ap.add_argument("--before", metavar="REV", help="also load with the code of commit REV")
    ap.add_argument("--processes", action="store_true",
                    help="also start-up to first token in two fresh processes: compiled-kernel caches cold, then warm")
    ap.add_argument("--vocab", help="write the test GGUF with this real vocabulary from "
                    "../shared/fixtures/vocab (e.g. qwen2: 151,936 tokens) instead of a tiny one")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                    help="with --vocab: the test GGUF's shape (llama3-8b: 4.6 GiB, Q4_K_M's mix)")
    ap.add_argument("--layers", type=int, help="with --shape: fewer layers than the shape has")
    ap.add_argument("--keep", type=Path, help="write the test GGUF here and keep it (default: a temp dir)")
    ap.add_argument("--no-uncached", action="store_true", help="skip the load with the cache off")
    ap.add_argument("--cache", type=Path, help="gmlx's cache folder: emptied first, kept after "
                    "(default: a temp dir, removed), e.g. for benchmarks/gpu/read_check.py")
    ap.add_argument("--profile", type=Path, help="write a py-spy profile of the cold load here (py-spy needed)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gmlx-cold-start-"))
    cache = args.cache or work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["GMLX_CACHE_DIR"] = str(cache)  # a private, empty cache
    if args.gguf:
        gguf_path = args.gguf
    elif args.vocab:
        name = f"test-{Path(args.vocab).stem}-{args.shape}-Q4_K_M.gguf"
        gguf_path = args.keep or work / name
        if not gguf_path.exists():
            start = time.perf_counter()
            _write_real_vocab_gguf(gguf_path, args.vocab, args.shape, args.layers)
            print(f"wrote {gguf_path} in {time.perf_counter() - start:.1f} s")
    else:
        gguf_path = _write_test_gguf(work / "test-qwen2-Q4_K.gguf")

    start = time.perf_counter()
    import mlx_lm.utils  # noqa: F401  (mlx-lm's model classes import transformers: paid once, before any timing)

    from gmlx.engine.loading import gguf, load_model

    print(f"imports {time.perf_counter() - start:.1f} s")

    try:
        print(f"{gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB)")
        uncached = None
        if not args.no_uncached:
            os.environ["GMLX_CONVERT_CACHE_BYTES"] = "0"
            uncached = _measure("uncached", lambda: gguf.load(gguf_path), args.repeat)
            os.environ.pop("GMLX_CONVERT_CACHE_BYTES")
        with _profiled(args.profile):
            cold = _measure("cold", lambda: gguf.load(gguf_path), 1)
        cached = _measure("cached", lambda: gguf.load(gguf_path), args.repeat)
        if uncached is not None:
            print(f"cached load is {uncached / cached:.1f}x faster than uncached ({cold / cached:.1f}x than cold)")
        if args.before:
            before = _before(args.before, gguf_path, work, args.repeat)
            print(f"cached load is {before / cached:.1f}x faster than commit {args.before}'s load")
        if args.processes:
            _processes(gguf_path, work)
        if args.mlx:
            _measure("mlx", lambda: load_model(str(args.mlx)), args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
