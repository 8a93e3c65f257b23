"""Random-weight models of real shapes, as GGUF files and MLX folders, for bench.py.

    python benchmarks/gpu/models.py --shape llama3-8b --out /tmp/models            # F16 GGUF + MLX bf16
    python benchmarks/gpu/models.py --shape llama3-8b --out /tmp/models \\
        --quantize /tmp/llama/build/bin/llama-quantize                           # + Q4_K_M, Q8_0, MLX 4-bit
    python benchmarks/gpu/models.py --shape llama3-8b --only gguf-q4_k_m --direct  # Q4_K_M alone, in seconds
    python benchmarks/gpu/models.py --shape tiny --out /tmp/gpumodels              # a CPU test

Written into OUT/SHAPE/ (each skipped when it exists; each written under a temporary
name and renamed when complete):

    f16.gguf        arch llama, F16 weights (norms F32), the tokenizer metadata of the
                    llama-bpe vocabulary GGUF (tokenizer.ggml.*) and a Llama-3-style chat
                    template (that GGUF has none); gmlx and llama-server load it directly
    tokenizer/      tokenizer.json + tokenizer_config.json alone (bench.py's client)
    mlx-bf16/       the same weights (bf16) for mlx-lm's llama: config.json, safetensors
                    shards, tokenizer.json + tokenizer_config.json built from the same
                    GGUF vocabulary with gmlx's own GGUF tokenizer builder
    q4_k_m.gguf     llama-quantize f16.gguf (with --quantize); or, with --direct, written
                    straight in llama-quantize's Q4_K_M layout from random blocks
                    (q4_k_m_direct.py): no F16 file, no llama.cpp build
    q8_0.gguf       llama-quantize f16.gguf (with --quantize)
    mlx-4bit/       mlx-lm's own quantization of mlx-bf16 (affine, 4 bits, group 64;
                    with --quantize), for mlx_lm.server

The weights are seeded normal(0, 0.02) draws (norms 1), drawn with MLX on its default
device (the GPU there) one tensor, or one slab of rows of a large tensor, at a time, so
memory stays bounded. Decode speed does not depend on the weights' values. The GGUF's
q/k rows are permuted the way llama.cpp's converter permutes a Hugging Face llama's, so
the GGUF and the MLX folder are the same model. `--direct`'s Q4_K_M is not that model: its
blocks are random bytes with scales set so each weight is centred on 0 with a standard
deviation of ~0.02, the same bytes and tensor types as a quantized file, for gmlx's speed alone.

Shapes:
  llama3-8b  Llama-3-8B: hidden 4096, 32 layers, ffn 14336, 32 heads, 8 kv heads, vocab 128256
  qwen1.5b   Qwen2.5-1.5B's sizes (hidden 1536, 28 layers, ffn 8960, 12 heads, 2 kv heads,
             tied embeddings) but the llama architecture (no q/k/v biases) and the
             llama-bpe vocabulary (128256 tokens, not Qwen's 151936)
  tiny       hidden 128, 2 layers, ffn 384, 4 heads, 2 kv heads, llama-bpe vocab (CPU tests)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"hidden": 4096, "layers": 32, "ffn": 14336, "heads": 32, "kv_heads": 8,
                  "rope_theta": 500000.0, "tied": False, "context": 8192},
    "qwen1.5b": {"hidden": 1536, "layers": 28, "ffn": 8960, "heads": 12, "kv_heads": 2,
                 "rope_theta": 1000000.0, "tied": True, "context": 32768},
    "tiny": {"hidden": 128, "layers": 2, "ffn": 384, "heads": 4, "kv_heads": 2,
             "rope_theta": 500000.0, "tied": False, "context": 8192},
}
# Llama 3's chat format; the llama-bpe vocabulary GGUF carries no template of its own.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
EOT = "<|eot_id|>"
SCALE = 0.02
SLAB = 1 << 26  # elements drawn at once (256 MiB of float32)
SHARD_BYTES = 4 << 30  # MLX safetensors shard size
DEFAULT_VOCABS = (
    os.environ.get("GPU_VOCAB", ""),
    "/tmp/gpu-stage/ggml-vocab-llama-bpe.gguf",
    str(ROOT / ".gpu" / "ggml-vocab-llama-bpe.gguf"),
    str(ROOT.parent / "shared" / "fixtures" / "vocab" / "ggml-vocab-llama-bpe.gguf"),
)


@dataclass
class Tensor:
    gguf: str  # GGUF name
    mlx: str  # MLX (Hugging Face) name
    shape: tuple[int, ...]  # numpy order (rows, cols)
    norm: bool = False  # ones, F32 in the GGUF
    permute_heads: int = 0  # q/k: llama.cpp's row permutation, over this many heads


def plan(s: dict[str, Any], vocab: int) -> list[Tensor]:
    h, f, hd = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    out = [Tensor("token_embd.weight", "model.embed_tokens.weight", (vocab, h))]
    for i in range(s["layers"]):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        out += [
            Tensor(b + "attn_norm.weight", m + "input_layernorm.weight", (h,), norm=True),
            Tensor(b + "attn_q.weight", m + "self_attn.q_proj.weight", (q, h), permute_heads=s["heads"]),
            Tensor(b + "attn_k.weight", m + "self_attn.k_proj.weight", (kv, h), permute_heads=s["kv_heads"]),
            Tensor(b + "attn_v.weight", m + "self_attn.v_proj.weight", (kv, h)),
            Tensor(b + "attn_output.weight", m + "self_attn.o_proj.weight", (h, q)),
            Tensor(b + "ffn_norm.weight", m + "post_attention_layernorm.weight", (h,), norm=True),
            Tensor(b + "ffn_gate.weight", m + "mlp.gate_proj.weight", (f, h)),
            Tensor(b + "ffn_up.weight", m + "mlp.up_proj.weight", (f, h)),
            Tensor(b + "ffn_down.weight", m + "mlp.down_proj.weight", (h, f)),
        ]
    out.append(Tensor("output_norm.weight", "model.norm.weight", (h,), norm=True))
    if not s["tied"]:
        out.append(Tensor("output.weight", "lm_head.weight", (vocab, h)))
    return out


def draw(t: Tensor, index: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF data: F16, or F32 for norms; MLX data: bf16 bits as uint16), one tensor."""
    import mlx.core as mx

    if t.norm:
        return np.ones(t.shape, np.float32), np.full(t.shape, 0x3F80, np.uint16)  # bf16 1.0
    rows, cols = t.shape
    f16 = np.empty(t.shape, np.float16)
    bf16 = np.empty(t.shape, np.uint16)
    step = max(1, SLAB // cols)
    for k, r0 in enumerate(range(0, rows, step)):
        r1 = min(rows, r0 + step)
        key = mx.random.key(seed * 1_000_003 + index * 4096 + k)
        x = mx.random.normal((r1 - r0, cols), key=key) * SCALE
        f16[r0:r1] = np.array(x.astype(mx.float16))
        bf16[r0:r1] = np.array(x.astype(mx.bfloat16).view(mx.uint16))
    if t.permute_heads:  # convert_hf_to_gguf.py's LlamaModel.permute
        n = t.permute_heads
        f16 = f16.reshape(n, 2, rows // n // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return f16, bf16


class SafetensorsShards:
    """Streams tensors into safetensors shards whose headers are known up front."""

    def __init__(self, folder: Path, tensors: list[Tensor]) -> None:
        shards: list[list[Tensor]] = [[]]
        size = 0
        for t in tensors:
            n = int(np.prod(t.shape)) * 2
            if shards[-1] and size + n > SHARD_BYTES:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += n
        self.folder = folder
        self.shards = shards
        self.names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.weight_map = {t.mlx: self.names[i] for i, sh in enumerate(shards) for t in sh}
        self.total = sum(int(np.prod(t.shape)) * 2 for t in tensors)
        self.fh: Any = None
        self.current = -1

    def write(self, t: Tensor, data: np.ndarray) -> None:
        if self.fh is None or t.mlx not in {x.mlx for x in self.shards[self.current]}:
            self._next()
        self.fh.write(np.ascontiguousarray(data).tobytes())

    def _next(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.current += 1
        header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        offset = 0
        for t in self.shards[self.current]:
            n = int(np.prod(t.shape)) * 2
            header[t.mlx] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.fh = (self.folder / self.names[self.current]).open("wb")
        self.fh.write(struct.pack("<Q", len(raw)) + raw)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def vocab_metadata(vocab_path: Path) -> dict[str, Any]:
    from gmlx.engine.loading.gguf_file import GGUFFile

    meta = {k: v for k, v in GGUFFile(vocab_path).metadata.items() if k.startswith("tokenizer.")}
    tokens = meta["tokenizer.ggml.tokens"]
    # A chat model's end of turn: Llama-3-Instruct GGUFs declare <|eot_id|> as EOS.
    if EOT in tokens:
        meta["tokenizer.ggml.eos_token_id"] = tokens.index(EOT)
    meta.setdefault("tokenizer.chat_template", CHAT_TEMPLATE)
    return meta


def write_tokenizer_metadata(w: Any, meta: dict[str, Any]) -> None:
    import gguf

    for key, value in meta.items():
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(value)
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types([int(x) for x in value])
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores([float(x) for x in value])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY)


def add_llama_metadata(w: Any, s: dict[str, Any], vocab: int, meta: dict[str, Any], file_type: Any) -> None:
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_vocab_size(vocab)
    w.add_file_type(file_type)
    write_tokenizer_metadata(w, meta)


def mlx_config(s: dict[str, Any], vocab: int, meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    eos = [meta["tokenizer.ggml.eos_token_id"]]
    eos += [tokens.index(t) for t in ("<|end_of_text|>", "<|eom_id|>") if t in tokens]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "intermediate_size": s["ffn"],
        "num_attention_heads": s["heads"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["hidden"] // s["heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": s["rope_theta"],
        "max_position_embeddings": s["context"],
        "vocab_size": vocab,
        "tie_word_embeddings": s["tied"],
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def write_mlx_tokenizer(folder: Path, vocab_path: Path, meta: dict[str, Any]) -> None:
    from gmlx.engine.loading.gguf_tokenizer import build_tokenizer

    tok = build_tokenizer(vocab_path, meta)
    tok.hf.chat_template = meta["tokenizer.chat_template"]
    tok.hf.save_pretrained(str(folder))
    # Make sure the template travels inside tokenizer_config.json too (older loaders).
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = meta["tokenizer.chat_template"]
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # a name every transformers version knows
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def write_f16_and_mlx(name: str, s: dict[str, Any], out: Path, vocab_path: Path, seed: int,
                      want_gguf: bool, want_mlx: bool) -> None:
    import gguf

    meta = vocab_metadata(vocab_path)
    vocab = len(meta["tokenizer.ggml.tokens"])
    tensors = plan(s, vocab)
    gguf_path, mlx_dir = out / "f16.gguf", out / "mlx-bf16"
    gguf_tmp, mlx_tmp = out / "f16.gguf.tmp", out / "mlx-bf16.tmp"
    t0 = time.perf_counter()

    w = None
    if want_gguf:
        w = gguf.GGUFWriter(None, "llama")
        w.add_name(f"random {name}")
        add_llama_metadata(w, s, vocab, meta, gguf.LlamaFileType.MOSTLY_F16)
        for t in tensors:
            dtype = np.float32 if t.norm else np.float16
            w.add_tensor_info(t.gguf, t.shape, np.dtype(dtype), int(np.prod(t.shape)) * np.dtype(dtype).itemsize)
        w.write_header_to_file(gguf_tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    shards = None
    if want_mlx:
        shutil.rmtree(mlx_tmp, ignore_errors=True)
        mlx_tmp.mkdir(parents=True)
        shards = SafetensorsShards(mlx_tmp, tensors)

    total = sum(int(np.prod(t.shape)) for t in tensors)
    done = 0
    for i, t in enumerate(tensors):
        g, b = draw(t, i, seed)
        if w is not None:
            w.write_tensor_data(g)
        if shards is not None:
            shards.write(t, b)
        done += int(np.prod(t.shape))
        if i % 20 == 0 or i == len(tensors) - 1:
            print(f"  {name}: {done / total:5.1%} of {total / 1e9:.2f} B parameters "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if w is not None:
        w.close()
        gguf_tmp.rename(gguf_path)
        print(f"wrote {gguf_path} ({gguf_path.stat().st_size / 2**30:.2f} GiB)")
    if shards is not None:
        shards.close()
        (mlx_tmp / "config.json").write_text(json.dumps(mlx_config(s, vocab, meta), indent=2))
        write_mlx_tokenizer(mlx_tmp, vocab_path, meta)
        mlx_tmp.rename(mlx_dir)
        size = sum(f.stat().st_size for f in mlx_dir.iterdir())
        print(f"wrote {mlx_dir}/ ({size / 2**30:.2f} GiB)")
    print(f"  in {time.perf_counter() - t0:.0f} s", flush=True)


def llama_quantize(tool: str, out: Path, kind: str, threads: int) -> None:
    target = out / f"{kind.lower()}.gguf"
    if target.exists():
        print(f"exists: {target}")
        return
    tmp = target.with_suffix(".gguf.tmp")
    t0 = time.perf_counter()
    r = subprocess.run([tool, str(out / "f16.gguf"), str(tmp), kind, str(threads)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800, check=False)
    if r.returncode != 0:
        print(r.stdout[-3000:])
        raise SystemExit(f"llama-quantize {kind} failed ({r.returncode})")
    tmp.rename(target)
    print(f"wrote {target} ({target.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")


def mlx_quantize(out: Path, bits: int = 4, group: int = 64) -> None:
    from mlx_lm import convert

    target = out / f"mlx-{bits}bit"
    if target.exists():
        print(f"exists: {target}")
        return
    tmp = out / f"mlx-{bits}bit.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    convert(hf_path=str(out / "mlx-bf16"), mlx_path=str(tmp), quantize=True, q_group_size=group, q_bits=bits)
    tmp.rename(target)
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"wrote {target}/ ({size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")


ARTIFACTS = ("gguf-f16", "mlx-bf16", "gguf-q4_k_m", "gguf-q8_0", "mlx-4bit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", type=Path, default=Path("/tmp/models"))
    p.add_argument("--vocab", type=Path, help="the llama-bpe vocabulary GGUF (default: the first found of "
                   + ", ".join(v for v in DEFAULT_VOCABS if v) + ")")
    p.add_argument("--quantize", metavar="LLAMA_QUANTIZE",
                   help="llama-quantize's path: also write Q4_K_M, Q8_0 and the MLX 4-bit folder")
    p.add_argument("--direct", action="store_true",
                   help="write q4_k_m.gguf straight from random blocks in Q4_K_M's layout (no F16, no "
                        "llama-quantize); with --only gguf-q4_k_m, the only file written besides tokenizer/")
    p.add_argument("--only", default=",".join(ARTIFACTS),
                   help=f"comma-separated subset of {','.join(ARTIFACTS)} (the quantized ones need --quantize)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    args = p.parse_args()

    vocab = args.vocab or next((Path(v) for v in DEFAULT_VOCABS if v and Path(v).is_file()), None)
    if vocab is None or not vocab.is_file():
        raise SystemExit("no llama-bpe vocabulary GGUF found; pass --vocab")
    only = set(args.only.split(","))
    if unknown := only - set(ARTIFACTS):
        raise SystemExit(f"unknown artifacts: {', '.join(sorted(unknown))}")
    out = args.out / args.shape
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    print(f"{args.shape} -> {out} (vocab {vocab}; {free / 2**30:.0f} GiB free)", flush=True)

    import mlx.core as mx

    print(f"drawing weights on {mx.default_device()}", flush=True)
    s = SHAPES[args.shape]
    if args.direct and "gguf-q4_k_m" in only:
        from benchmarks.gpu.q4_k_m_direct import write_q4_k_m_direct

        write_q4_k_m_direct(args.shape, s, out, vocab, args.seed)
    want_gguf = "gguf-f16" in only and not (out / "f16.gguf").exists()
    # the F16 GGUF is the input of llama-quantize
    if args.quantize and ({"gguf-q4_k_m", "gguf-q8_0"} & only) and not (out / "f16.gguf").exists():
        want_gguf = True
    want_mlx = ("mlx-bf16" in only or (args.quantize and "mlx-4bit" in only)) and not (out / "mlx-bf16").exists()
    for f, want in (("f16.gguf", want_gguf), ("mlx-bf16", want_mlx)):
        if not want and (out / f).exists():
            print(f"exists: {out / f}")
    if want_gguf or want_mlx:
        write_f16_and_mlx(args.shape, s, out, vocab, args.seed, want_gguf, want_mlx)
    if not (out / "tokenizer").exists():
        tmp = out / "tokenizer.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_mlx_tokenizer(tmp, vocab, vocab_metadata(vocab))
        tmp.rename(out / "tokenizer")
    if args.quantize:
        for kind in ("Q4_K_M", "Q8_0"):
            if f"gguf-{kind.lower()}" in only:
                llama_quantize(args.quantize, out, kind, args.threads)
        if "mlx-4bit" in only:
            mlx_quantize(out)
    for f in sorted(out.iterdir()):
        size = f.stat().st_size if f.is_file() else sum(x.stat().st_size for x in f.iterdir())
        print(f"  {f.name:<14} {size / 2**30:8.2f} GiB")


if __name__ == "__main__":
    main()
