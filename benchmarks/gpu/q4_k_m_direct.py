"""A Q4_K_M GGUF of a ``models.py`` shape written straight from random blocks, in the
layout llama-quantize's Q4_K_M gives a llama (the same tensor types: :func:`q4_k_m_type`),
with no F16 file and no llama.cpp build (``models.py --direct``; ~20 s for the 8B).

Not the model of ``models.py``'s F16 draws: its blocks are random bytes with scales set so
each weight is centred on 0 with a standard deviation of ~0.02 (a decode on it stays
finite, and a load's agreement checks run on sensible values), the same bytes and tensor
types as a quantized file, for gmlx's speed alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu.models import add_llama_metadata, plan, vocab_metadata

# Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values; a weight
# is d * scale * q - dmin * min. Every sub-block's scale 8 and min 60 with dmin = d centre the
# 4-bit values' 0..15 on 0 (8 * 7.5 = 60), and d = 5.4e-4 gives a standard deviation of ~0.02.
# The 12 bytes pack scale 8 and min 60 into each of the 8 sub-blocks (ggml's get_scale_min_k4).
Q4_K_SCALES = bytes([8] * 4 + [252] * 4 + [200] * 4)
Q4_K_D = 5.4e-4
# Q6_K: 128 + 64 bytes of 6-bit values (0..63, centred on 32 by the format), 16 int8 scales,
# f16 d: scales 16 and d = 6.8e-5 give ~0.02.
Q6_K_SCALE, Q6_K_D = 16, 6.8e-5


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives 6 bits in attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> str:
    """The type llama-quantize's Q4_K_M gives a llama tensor (llama_tensor_get_type, one expert,
    not 70B): the output layer Q6_K, attn_v and ffn_down Q6_K in more_bits layers, norms F32,
    all else Q4_K."""
    if name.endswith("norm.weight"):
        return "F32"
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if more_bits(int(name.split(".")[1]), layers) else "Q4_K"
    return "Q4_K"


def random_blocks(kind: str, count: int, rng: np.random.Generator, pool: dict[str, np.ndarray]) -> np.ndarray:
    """``count`` valid blocks of ``kind`` (Q4_K or Q6_K) as uint8 rows: random values, the
    scales above. Drawn from one pool of blocks per kind, taken from a random offset, so an
    8B file is written in seconds."""
    import gguf

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    if kind not in pool:
        b = rng.integers(0, 256, (1 << 16, size), dtype=np.uint8)
        if kind == "Q4_K":
            b[:, 0:2] = b[:, 2:4] = np.frombuffer(np.float16(Q4_K_D).tobytes(), np.uint8)
            b[:, 4:16] = np.frombuffer(Q4_K_SCALES, np.uint8)
        else:
            b[:, 192:208] = Q6_K_SCALE
            b[:, 208:210] = np.frombuffer(np.float16(Q6_K_D).tobytes(), np.uint8)
        pool[kind] = b
    b = pool[kind]
    start = int(rng.integers(0, len(b)))
    return np.resize(np.roll(b, -start, axis=0), (count, size))


def write_q4_k_m_direct(name: str, s: dict[str, Any], out: Path, vocab_path: Path, seed: int) -> None:
    """q4_k_m.gguf in llama-quantize's Q4_K_M layout from random blocks (no F16, no llama.cpp)."""
    import gguf

    target = out / "q4_k_m.gguf"
    if target.exists():
        print(f"exists: {target}")
        return
    meta = vocab_metadata(vocab_path)
    vocab = len(meta["tokenizer.ggml.tokens"])
    tensors = plan(s, vocab)
    if bad := [t.gguf for t in tensors if not t.norm and t.shape[1] % 256]:
        raise SystemExit(f"--direct needs rows of a multiple of 256 values (K-quant blocks): {bad[0]}")
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(None, "llama")
    w.add_name(f"random {name} (Q4_K_M layout, random blocks)")
    add_llama_metadata(w, s, vocab, meta, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    kinds = [q4_k_m_type(t.gguf, s["layers"]) for t in tensors]
    for t, kind in zip(tensors, kinds):
        if kind == "F32":
            w.add_tensor_info(t.gguf, t.shape, np.dtype(np.float32), int(np.prod(t.shape)) * 4)
            continue
        qt = gguf.GGMLQuantizationType[kind]
        row = t.shape[1] // 256 * gguf.GGML_QUANT_SIZES[qt][1]
        w.add_tensor_info(t.gguf, (t.shape[0], row), np.dtype(np.uint8), t.shape[0] * row, raw_dtype=qt)
    tmp = target.with_suffix(".gguf.tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng, pool = np.random.default_rng(seed), {}
    for t, kind in zip(tensors, kinds):
        if kind == "F32":
            w.write_tensor_data(np.ones(t.shape, np.float32))
        else:
            blocks = random_blocks(kind, t.shape[0] * (t.shape[1] // 256), rng, pool)
            w.write_tensor_data(blocks.reshape(t.shape[0], -1))
    w.close()
    tmp.rename(target)
    print(f"wrote {target} ({target.stat().st_size / 2**30:.2f} GiB, {kinds.count('Q6_K')} Q6_K tensors) "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
