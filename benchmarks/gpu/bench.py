"""Served speed on the H200: gmlx against mlx_lm.server and llama.cpp's llama-server.

    python benchmarks/gpu/bench.py --models llama3-8b:f16,llama3-8b:q4 --out $OUT/bench.md
    python benchmarks/gpu/bench.py --shape tiny --widths 1,2 --tokens 16    # a CPU check

Models come from models.py (``--models-dir``, default /tmp/models). A variant is
SHAPE:QUANT, and each quant names what each server loads:

    f16  gmlx: f16.gguf        mlx_lm.server: mlx-bf16/   llama-server: f16.gguf
    q4   gmlx: q4_k_m.gguf     mlx_lm.server: mlx-4bit/   llama-server: q4_k_m.gguf
    q8   gmlx: q8_0.gguf       mlx_lm.server: (none)      llama-server: q8_0.gguf

(``--gmlx-mlx`` adds gmlx on the MLX folder too, as "gmlx-mlx"; ``gmlx-flat`` and
``gmlx-plain`` in ``--servers`` add gmlx on the same file with its CUDA quantized layers
only flattened, or left as MLX makes them: ``GMLX_QMV_KERNEL=flat`` / ``0``;
``gmlx-graph400`` adds it with MLX's own CUDA graph-cache settings, capacity 400 and the
thrashing fuse on, where gmlx sets 4000 and off; ``gmlx-ops80`` with CUDA graphs of up to
80 kernels instead of MLX's 20; ``gmlx-cudnn`` with cuDNN's attention; ``gmlx-stacked`` with q/k/v and gate/up stacked
into one product each; ``gmlx-mlxattend`` with a padded batch's attention in MLX's general path (gmlx's kernel off);
``gmlx-handover8`` handing each forward over every 8 layers on a second thread; ``gmlx-kernels`` with
the fused adds and norms and the rope kernel (both off by default); ``gmlx-cached`` / ``gmlx-whole``
set what is now the default explicitly (a one-token step's keys and values written in place by its
attention kernel; the whole one-token step one compiled call); ``gmlx-nowhole`` is the default
without the whole step, ``gmlx-nocached`` without the in-place attention either (the default
until 12-05); ``mlx_lm-gmlxenv`` is
mlx_lm.server with the MLX settings gmlx makes, so only the server differs). One server
runs at a time (memory), started in its own session on a free 127.0.0.1 port and always killed.
Each is driven by benchmarks/throughput.py's client (imported, not copied): streaming
chat completions, greedy, every special and partial-UTF-8 token biased -100 so each
stream runs to ``--tokens``. All three decode at most max(--widths) streams together
(gmlx --decode-batch, mlx_lm --decode-concurrency, llama-server -np; llama-server gets
-c = slots x the tokens one request needs).

Per server:
  - ready: seconds from start until /health?ready=1 answers 200 (gmlx: loaded and warmed up);
  - first TTFT: the first request right after ready (a ``--prompt``-token prompt, 8
    output tokens), then a second one alike; "steady" is the width-1 TTFT p50 measured
    later; the issue's bar: first <= 2x steady;
  - widths: one untimed round (8 tokens) then ``--rounds`` timed rounds per width;
    aggregate decode tok/s as throughput.py defines it (tokens after the last stream's
    first token / (last finish - that moment)); TTFT p50/p95 over all timed streams;
  - prefix reuse: a ~``--prefix``-token system prompt, a miss then a hit (throughput.py's
    prefix_pair), ``--prefix-reps`` times; medians.

Fraction of the bandwidth floor: a decode step reads every weight once (the token
embedding excepted: it is a lookup, unless it doubles as the output layer), whatever the
number of streams in the step, so

    floor fraction = (tok/s / width) x B / BW

with B = the weight bytes of the file/folder the server loads (as stored: F16, Q4_K_M,
MLX 4-bit, ...; KV-cache reads ignored) and BW = ``--bandwidth``, by default the card's
datasheet figure from ``nvidia-smi``'s name (H200 4.8 TB/s, where a device-to-device copy
measured ~4.3; H100 SXM 3.35 TB/s). At width 1 that is
measured tok/s over the single-stream floor BW / B.

Results accumulate as JSON in ``--results`` (one file per variant and server), so calls
can be split; a server named twice in one call (``--servers gmlx,gmlx-nocompile,gmlx,gmlx-nocompile``:
alternating pairs) keeps each run, the second as ``gmlx#2``; every table is rebuilt from all of them after each server and written to
``--out`` (markdown; all the JSON results beside it, same name, .json) as well as printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The environment this script was started with: what every server gets. Importing
# gmlx.engine here (weight_bytes reads GGUF headers with gmlx's reader) sets gmlx's MLX
# defaults in this process, which must not leak into the peers.
LAUNCH_ENV = dict(os.environ)
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import openai
import throughput as tp

from benchmarks.gpu import profile_summary
from gmlx.engine import MLX_CUDA_DEFAULTS

PEERS = ("mlx_lm", "mlx_lm-gmlxenv", "llama")
# gmlx on the same file as "gmlx", in another environment: its CUDA quantized layers as
# fast_linear's GMLX_QMV_KERNEL says (only flattened, or left as MLX makes them), or MLX's
# own CUDA graph-cache settings (gmlx.engine's MLX_CUDA_DEFAULTS say why gmlx changes them)
GMLX_VARIANTS = {
    "gmlx-flat": {"GMLX_QMV_KERNEL": "flat"},
    "gmlx-plain": {"GMLX_QMV_KERNEL": "0"},
    "gmlx-graph400": {"MLX_CUDA_GRAPH_CACHE_SIZE": "400", "MLX_ENABLE_CACHE_THRASHING_CHECK": "1"},
    # MLX replays a step as CUDA graphs of at most this many kernels (its default 20):
    # fewer, larger graphs per step may cost the host less at width 1
    "gmlx-ops80": {"MLX_MAX_OPS_PER_BUFFER": "80"},
    # (MLX's CUDA backend wants it under 255): a traced one-stream step (H100, 12-06) had
    # ~0.3 ms a step of gaps between kernels beside 3.6 ms busy, ~21 graphs a step of 424 kernels
    "gmlx-ops200": {"MLX_MAX_OPS_PER_BUFFER": "200"},
    # MLX's attention through cuDNN's fused kernel (gmlx turns it off: its graphs are
    # built and compiled per shape, inside the request that first meets one)
    "gmlx-cudnn": {"MLX_CUDA_USE_CUDNN_SDPA": "1"},
    # a padded batch's one-query attention in MLX's general path (kernels.attention_cuda off)
    "gmlx-mlxattend": {"GMLX_ATTENTION_KERNEL": "0"},
    # each forward handed over every 8 layers on a second thread (gmlx.engine.handover; off by default)
    "gmlx-handover8": {"GMLX_HANDOVER_LAYERS": "8"},
    # a one-token step's residual adds and norms fused, its queries and keys rotated in one
    # kernel (gmlx.engine.kernels.add_norm_cuda, rope_cuda; off by default until measured)
    "gmlx-kernels": {"GMLX_ADD_NORM_KERNEL": "1", "GMLX_ROPE_KERNEL": "1"},
    # an MLP's gate and up projections and swiglu in one kernel at every decode step of up
    # to eight streams, untimed (gmlx.engine.kernels.glu_cuda; "gmlx" takes it where its
    # load measures a step faster), or never
    "gmlx-glu": {"GMLX_GLU_KERNEL": "1"},
    "gmlx-noglu": {"GMLX_GLU_KERNEL": "0"},
    # an attention's queries, keys and values in one product (qkv_cuda) never; neither
    # step kernel (glu_cuda, qkv_cuda): the server as before them
    "gmlx-noqkv": {"GMLX_QKV_KERNEL": "0"},
    # the q-k-v product at every decode step of up to 64 streams, untimed (12-06 midday H100:
    # forced at one stream, which the load's whole-step timing had not taken, the step's
    # kernels summed 0.47 ms less and the GPU was busy 0.11 ms less)
    "gmlx-qkv": {"GMLX_QKV_KERNEL": "1"},
    # the one-token step's queries and keys rotated in one kernel, its adds and norms fused,
    # each alone (rope_cuda, add_norm_cuda; off by default)
    "gmlx-rope": {"GMLX_ROPE_KERNEL": "1"},
    "gmlx-addnorm": {"GMLX_ADD_NORM_KERNEL": "1"},
    "gmlx-nostep": {"GMLX_GLU_KERNEL": "0", "GMLX_QKV_KERNEL": "0"},
    # the 12-06 additions (off by default since that day's H100 lease served one stream at
    # 176 tok/s against 276 on 12-05), one at a time, then all four: one stream's attention
    # with a head split; the products' paths timed in a chain (tuned again under keys of
    # their own); the one-row products' staged shapes (likewise); the step kernels' one-row
    # launch shapes timed
    "gmlx-hsplit": {"GMLX_HEAD_SPLIT": "1"},
    "gmlx-chain": {"GMLX_PRODUCT_TIMING": "chain"},
    "gmlx-staged": {"GMLX_STAGED": "1"},
    "gmlx-shapes": {"GMLX_STEP_SHAPES": "1"},  # the default since 12-06 evening (as is "gmlx")
    "gmlx-noshapes": {"GMLX_STEP_SHAPES": "0"},
    # the launch shapes timed by the device's part alone (each chain behind a lead product):
    # on the H200 (12-06 night) the plain chain timed every q-k-v shape at the host's ~22-26 us
    "gmlx-deviceshapes": {"GMLX_STEP_SHAPES": "device"},
    # the one-row products' (and the fused step kernels') K split between a block's warps, timed
    # beside the other shapes (tuned under keys of their own): the down products and the
    # o-projection of 4,096 outputs read at 1.4-1.8 TB/s on the H200 (12-06 night) with 2-8
    # warps a streaming multiprocessor. Since 12-07 10:00 the 4-bit products' split shapes
    # round x too (qgemv_split.split_rounded); gmlx-q8all-splitk: the 6-bit ones as well
    "gmlx-splitk": {"GMLX_SPLIT_K": "1"},
    "gmlx-q8all-splitk": {"GMLX_SPLIT_K": "1", "GMLX_Q8X": "all"},
    # the normed one-row products (the gate-up-swiglu, the q-k-v) with x's floats made once a
    # block in shared memory and the next chunk's weights loaded while this one is summed
    # (426 SASS instructions a chunk of the normed gate-up at 4x4 against 591)
    "gmlx-prepared": {"GMLX_PREPARED": "1"},
    "gmlx-prepared-async": {"GMLX_PREPARED": "1", "GMLX_ASYNC": "1"},
    # the 4-bit one-row products with x rounded to bytes once a block and the codes summed
    # against it four at a time (__dp4a; 182 SASS instructions a chunk of the normed gate-up
    # at 4x4 against 591, 47 against 284 for the q-k-v at 8x1), as llama.cpp's products round
    # their x; the load holds them to qgemv_q8.TOLERANCE. The default since 12-07 (H200: one
    # stream 313 and 336 tok/s against 294); gmlx-noq8: the float sums, as before
    "gmlx-q8x": {"GMLX_Q8X": "1"},
    "gmlx-noq8": {"GMLX_Q8X": "0"},
    # the 6-bit one-row products round x too (a Q4_K_M's 6-bit down products and values;
    # 386 SASS instructions a chunk of the 6-bit down product against 681)
    "gmlx-q8all": {"GMLX_Q8X": "all"},
    # both, with the launch shapes timed by the device's part alone (gmlx-deviceshapes)
    "gmlx-q8all-device": {"GMLX_Q8X": "all", "GMLX_STEP_SHAPES": "device"},
    # the rounded one-row products with 2-4 chunks a lane in flight, the first ones loaded
    # before the block rounds x (qgemv_q8.DEEP shapes timed beside the others; 12-07: the
    # rounded gate-up read at 2.27 TB/s of the H100's 3.35 with one chunk in flight)
    "gmlx-q8deep": {"GMLX_Q8_DEPTH": "1"},
    # the bytes a multiprocessor keeps in flight, both ways at once, for a card whose
    # bandwidth the one-chunk products leave unused (the H200: one stream's step ~3.0 ms on
    # it and on the H100 alike): more chunks a lane for the wide grids (the gate-up), K split
    # between more warps for the small ones (the down products, q-k-v, o-projection: 256-384
    # blocks of 4 warps, 2-3 a multiprocessor), the 6-bit products rounded too; each product
    # takes what its tuner times fastest. The defaults since 12-07 evening (H100, the synthetic
    # 8B's served step in process: 2.85 ms against 3.13); gmlx-noinflight: the defaults before
    "gmlx-inflight": {"GMLX_Q8_DEPTH": "1", "GMLX_SPLIT_K": "1", "GMLX_Q8X": "all"},
    "gmlx-noinflight": {"GMLX_Q8_DEPTH": "0", "GMLX_SPLIT_K": "0", "GMLX_Q8X": "1"},
    # a greedy step's argmax by MLX's reduction (23-25 us of the 8B's one-stream step on the
    # H100, 12-06), not gmlx's kernel (argmax_cuda: a block of 1,024 threads a row, default
    # since 12-07 night, not yet timed on a GPU)
    "gmlx-noargmax": {"GMLX_ARGMAX_KERNEL": "0"},
    # one stream's wide attention in the launch shape its load times fastest (fewer warps a
    # block, more keys in flight a warp: cached_attention_cuda.wide_shapes), not its one shape
    # of 32 warps walking their keys a load at a time; on the H100 (12-07) none beat that
    # one at 1,000 keys (25.1 us against 29.1-58.4 chained): off by default
    "gmlx-wideshapes": {"GMLX_ATTENTION_WIDE_SHAPES": "1"},
    # the rope folded into the in-place attention (a key a warp, wide or not) in each lane's
    # registers, not through shared memory behind a barrier (the rope cost the wide form ~4 us
    # a call on the H100, 12-07: 10.2 against 14.0 us at 38 keys, chained)
    "gmlx-ropelanes": {"GMLX_ROPE_LANES": "1"},
    # every one-row form offered to the tuners at once (the 6-bit products rounded and K split
    # between warps, both default since 12-07 evening, and the weights streamed, not), each
    # shape timed by the device's part alone: the load log says which won where
    "gmlx-candidates": {"GMLX_Q8X": "all", "GMLX_STEP_SHAPES": "device", "GMLX_SPLIT_K": "1", "GMLX_ASYNC": "1"},
    # the one-row products' weights streamed through shared memory (asynchronous copies, 2-4
    # rounds of a warp's chunks in flight at one chunk's registers), timed beside the others
    "gmlx-async": {"GMLX_ASYNC": "1"},
    # the queries, keys and 6-bit values of a Q4_K_M layer in two normed launches at one stream, as before 12-06 evening
    "gmlx-nomixed": {"GMLX_QKV_MIXED": "0"},
    # MLX's CUDA graphs: its CommandEncoder commits a graph each 30 operations or 400 MB of
    # inputs on sm_90 (an 8B Q4_K_M step reads 4.3 GB: ~11 commits, each an update, a launch
    # and a completion handler); a host-paced step may gain from fewer (bigbuffers) or none
    # (nographs: each kernel launched as it is encoded, the GPU starting at once)
    "gmlx-nographs-steptimes": {"MLX_USE_CUDA_GRAPHS": "0", "GMLX_STEP_TIMES": "128"},
    "gmlx-bigbuffers-steptimes": {"MLX_MAX_OPS_PER_BUFFER": "400", "MLX_MAX_MB_PER_BUFFER": "16000",
                                  "GMLX_STEP_TIMES": "128"},
    # the two that each took one stream past 0.4 of the floor on 12-06 (19:30 lease), together
    "gmlx-shapes80": {"GMLX_STEP_SHAPES": "1", "MLX_MAX_OPS_PER_BUFFER": "80"},
    "gmlx-all1206": {"GMLX_HEAD_SPLIT": "1", "GMLX_PRODUCT_TIMING": "chain", "GMLX_STAGED": "1",
                     "GMLX_STEP_SHAPES": "1"},
    # q/k/v and gate/up stacked into one product each (gmlx.engine.kernels.fused; off by default)
    "gmlx-stacked": {"GMLX_FUSE_PROJECTIONS": "1"},
    # the defaults, the worker logging its decode steps' phases every 128 steps (the run log:
    # build, hand over, wait, read, between; gmlx.engine.step_times)
    "gmlx-steptimes": {"GMLX_STEP_TIMES": "128"},
    # each kernel's source inline, as before 12-08 (the default is an #include of a file,
    # cuda_source.kernel_source: MLX hashes the source it holds at every evaluation, ~7.8 KB a
    # one-row product whole, ~0.1 included; the same PTX, include_check.py; one stream's
    # hand-over 1.89-1.98 ms a step included against 2.08-2.16 inline, H100 12-07 23:43)
    "gmlx-inline-steptimes": {"GMLX_KERNEL_INCLUDE": "0", "GMLX_STEP_TIMES": "128"},
    # a block's q/k/v and gate/up weights stacked into one array each at load, the one-row
    # kernels reading 3 arrays where they read 9 or 6 (gmlx.engine.kernels.stacked; off by
    # default until served: ~1 us of the host's time an array a call, call_cost.py)
    "gmlx-stackedweights-steptimes": {"GMLX_STACKED": "1", "GMLX_STEP_TIMES": "128"},
    # the defaults with a decode batch of 32 whatever the widths run (DECODE_BATCHES), phases
    # logged: a server started for widths 1, 8 and 32 served one stream 18% slower on the
    # H100 (12-07 evening: 254.8 against 309.0 tok/s, the second from the first's tuning
    # and at a decode batch of 1) and 7% on the H200 (12-07 morning, the same pair)
    "gmlx-batch32-steptimes": {"GMLX_STEP_TIMES": "128"},
    # the norm before each MLP left to MLX's kernel (12-06 evening's fold off: one kernel a layer more)
    "gmlx-nofold": {"GMLX_NORM_FOLD": "0"},
    # fewer kernels a step (the q-k-v product at one row: -48; the rope in the attention:
    # -64), which moved the bare loop's GPU time by 1-3% (12-06 evening) but, where the served
    # loop is the host's, each kernel fewer is one fewer handed over: with the phases logged
    "gmlx-fewer-steptimes": {"GMLX_QKV_KERNEL": "1", "GMLX_ROPE_ATTENTION": "1", "GMLX_STEP_TIMES": "128"},
    # and the norm before the attention folded into the q-k-v product at one stream (-32 more)
    "gmlx-fewest-steptimes": {"GMLX_QKV_KERNEL": "1", "GMLX_ROPE_ATTENTION": "1", "GMLX_QKV_NORM": "1",
                              "GMLX_STEP_TIMES": "128"},
    # (12-06 evening's lease: the rope and the norm folds, both defaults since; these two
    # turn them off again for a comparison)
    "gmlx-nofewer-steptimes": {"GMLX_ROPE_ATTENTION": "0", "GMLX_QKV_NORM": "0", "GMLX_STEP_TIMES": "128"},
    # the layers' rope folded into the in-place attention (one operation a layer fewer:
    # cached_attention_cuda.folded_rope), and that with the add-norm kernel in the compiled
    # blocks (two more): 11-12 operations a layer of the 8B's step down to 8
    "gmlx-fold": {"GMLX_ROPE_ATTENTION": "1"},
    "gmlx-fused": {"GMLX_ROPE_ATTENTION": "1", "GMLX_ADD_NORM_KERNEL": "1"},
    # the in-place attention's code shorter (cached_attention_cuda.compact): built for dense
    # rows alone, and that with 4 keys (a key a lane: rows of values) in flight, not 16
    # one stream's whole attention never in the wide form (cached_attention_cuda.wide_threads;
    # by default the load times it and takes it where it wins)
    "gmlx-nowide": {"GMLX_ATTENTION_WIDE": "0"},
    # the blocks' residual adds as MLX's adds, not in the one-row products' launches
    # (fast_linear.plus; by default where the product takes the one-row kernel)
    "gmlx-noresidual": {"GMLX_RESIDUAL_KERNEL": "0"},
    # (the dense build is the default since 12-06 midday: "gmlx-strided" builds both paths)
    "gmlx-dense": {"GMLX_ATTENTION_DENSE": "1"},
    "gmlx-strided": {"GMLX_ATTENTION_DENSE": "0"},
    "gmlx-compact": {"GMLX_ATTENTION_DENSE": "1", "GMLX_ATTENTION_IN_FLIGHT": "4"},
    # each llama-pattern block's one-token step in two compiled pieces
    # (gmlx.engine.kernels.compiled_blocks: on by default on the CPU and CUDA, off on Metal), or never
    "gmlx-compiled": {"GMLX_COMPILE_BLOCKS": "1"},
    "gmlx-nocompile": {"GMLX_COMPILE_BLOCKS": "0"},
    # the compiled blocks with the rope kernel inside them ("gmlx-kernels": the rope and the
    # add-norm kernels, inside the compiled blocks now that they are the default)
    "gmlx-allkernels": {"GMLX_COMPILE_BLOCKS": "1", "GMLX_ROPE_KERNEL": "1"},
    # a one-token step's keys and values written into the batch cache in place by its
    # attention kernel (cached_attention_cuda.attend_cached: five operations fewer a layer) without
    # the whole step, and that with the whole one-token step one compiled call
    # (gmlx.engine.kernels.whole_step): both on by default since 12-05, so "gmlx-whole" is
    # "gmlx" and "gmlx-nowhole" the same as "gmlx-cached"
    "gmlx-cached": {"GMLX_CACHE_ATTENTION": "1", "GMLX_WHOLE_STEP": "0"},
    "gmlx-whole": {"GMLX_CACHE_ATTENTION": "1", "GMLX_WHOLE_STEP": "1"},
    "gmlx-nowhole": {"GMLX_WHOLE_STEP": "0"},
    "gmlx-nocached": {"GMLX_CACHE_ATTENTION": "0"},
}
# every server a run may name, in the tables' column order (a variant is one of these only
# once it is here: the 12-06 variants were missing, so their lease calls would have been refused)
SERVERS = ("gmlx", *GMLX_VARIANTS, "gmlx-mlx", *PEERS)
# mlx_lm.server with the MLX settings gmlx makes (gmlx.engine's MLX_CUDA_DEFAULTS): the
# same engine settings on both sides, so the difference is the server (issue 19, point 4)
PEER_VARIANTS = {"mlx_lm-gmlxenv": dict(MLX_CUDA_DEFAULTS)}
# What a gmlx server's log says about its load (conversion, the tuner's choices, warm-up)
# and anything that went wrong: kept with its result, as the log itself is lost with the
# device machine.
LOG_KEYS = ("loaded ", "warmed up", "cuda:", "convert", "cache", "hrashing", "uncompiled", "WARNING", "ERROR",
            "Traceback", "decode steps of")
# quant -> server -> the file or folder (inside MODELS_DIR/SHAPE) it loads
FILES: dict[str, dict[str, str | None]] = {
    "f16": {"gmlx": "f16.gguf", "gmlx-mlx": "mlx-bf16", "mlx_lm": "mlx-bf16", "llama": "f16.gguf"},
    "q4": {"gmlx": "q4_k_m.gguf", "gmlx-mlx": "mlx-4bit", "mlx_lm": "mlx-4bit", "llama": "q4_k_m.gguf"},
    "q8": {"gmlx": "q8_0.gguf", "gmlx-mlx": None, "mlx_lm": None, "llama": "q8_0.gguf"},
}
for _files in FILES.values():
    _files.update({variant: _files["gmlx"] for variant in GMLX_VARIANTS})
    _files.update({variant: _files["mlx_lm"] for variant in PEER_VARIANTS})
LLAMA_SERVER_PATHS = ("/tmp/llama/build/bin/llama-server",)
# Process groups of the servers this script started: a run killed at a device call's limit
# leaves its server (own session) running; the next run ends it before starting another.
PIDFILE = Path("/tmp/gpu-bench-servers.pids")


def end_leftovers() -> None:
    if not PIDFILE.exists():
        return
    for line in PIDFILE.read_text().split():
        try:
            os.killpg(int(line), signal.SIGKILL)
            print(f"ended a leftover server (process group {line})", flush=True)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    PIDFILE.unlink()


# -- weight bytes -----------------------------------------------------------------------


def weight_bytes(path: Path) -> int:
    """Bytes of weights a decode step reads: all tensors but the token embedding (a
    lookup), which counts when there is no separate output layer (tied)."""
    sizes: dict[str, int] = {}
    if path.is_file():
        from gmlx.engine.loading.gguf_file import GGUFFile

        sizes = {name: t.nbytes for name, t in GGUFFile(path).tensors.items()}
        embed, head = ("token_embd.",), ("output.",)
    else:
        for f in sorted(path.glob("*.safetensors")):
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
        embed, head = ("model.embed_tokens.",), ("lm_head.",)
    tied = not any(k.startswith(head) for k in sizes)
    return sum(v for k, v in sizes.items() if tied or not k.startswith(embed))


# -- one server ---------------------------------------------------------------------------


def find_llama_server() -> str | None:
    for p in (os.environ.get("LLAMA_SERVER", ""), *LLAMA_SERVER_PATHS):
        if p and os.access(p, os.X_OK):
            return p
    return shutil.which("llama-server")


# a server's decode batch where it is not the widest width run (``--decode-batch``)
DECODE_BATCHES = {"gmlx-batch32-steptimes": 32}


def make_server(kind: str, model: Path, workdir: Path, args: argparse.Namespace) -> tp.Server:
    home = args.gmlx_home or workdir / f"gmlx-home-{kind}"
    home.mkdir(parents=True, exist_ok=True)
    env = {**LAUNCH_ENV, "GMLX_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    # the working tree's gmlx first, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    slots = DECODE_BATCHES.get(kind, max(args.widths))
    log = workdir / f"{kind}.log"
    env.update(GMLX_VARIANTS.get(kind, {}) | PEER_VARIANTS.get(kind, {}))
    if kind.startswith("gmlx"):
        s = tp.Server(kind, [sys.executable, "-m", "gmlx.cli.main", "serve", str(model),
                            "--decode-batch", str(slots), *args.gmlx_args], env, log)
        s.health = "/health?ready=1"  # ready: loaded and warmed up
        s.argv += ["--port", str(s.port)]
    elif kind.startswith("mlx_lm"):
        s = tp.Server(kind, [sys.executable, "-m", "mlx_lm.server", "--model", str(model),
                             "--log-level", "WARNING", "--decode-concurrency", str(slots), *args.peer_args],
                      env, log)
        s.argv += ["--port", str(s.port)]
        s.model = "default_model"
    else:
        binary = find_llama_server()
        assert binary is not None
        per_slot = max(args.prompt, args.prefix + 128) + args.tokens + 128
        per_slot = -(-per_slot // 256) * 256
        s = tp.Server(kind, [binary, "-m", str(model), "--host", "127.0.0.1", "-ngl", "999",
                             "-c", str(per_slot * slots), "-np", str(slots), "--cont-batching",
                             "--no-webui", *args.llama_args], env, log)
        s.argv += ["--port", str(s.port)]
    s.argv = [a for a in s.argv if a != ""]
    return s


async def drive(s: tp.Server, prompts: tp.Prompts, args: argparse.Namespace, result: dict[str, Any]) -> None:
    bias = {str(i): -100 for i in prompts.banned_ids}
    client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0,
                                timeout=tp.REQUEST_TIMEOUT_S)
    try:
        if not s.model:
            s.model = (await client.models.list()).data[0].id
        # the first request after ready, then a second: both timed (the client's own
        # first-call costs paid before, against a fake server)
        await tp.warm_sdk()
        firsts = []
        for tag in ("first", "second"):
            msg = [{"role": "user", "content": prompts.text(f"{tag}{s.name}", args.prompt)}]
            firsts.append(await tp.stream_chat(client, s.model, msg, 8, bias))
        result["first_ttft"], result["second_ttft"] = firsts[0].ttft, firsts[1].ttft
        print(f"  {s.name}: first TTFT {firsts[0].ttft * 1000:.0f} ms, second {firsts[1].ttft * 1000:.0f} ms",
              flush=True)
        result["widths"] = []
        for width in args.widths:
            res = tp.WidthResult(width)
            await tp.run_round(s, client, prompts, width, args.prompt, 8, f"w{width}warm", bias, tp.WidthResult(width))
            for r in range(args.rounds):
                await tp.run_round(s, client, prompts, width, args.prompt, args.tokens, f"w{width}r{r}", bias, res)
            result["widths"].append({
                "width": width, "rates": res.rates, "decode_tok_s": res.decode_tok_s,
                "ttft_p50": res.ttft(0.5), "ttft_p95": res.ttft(0.95), "tokens": res.tokens, "chunks": res.chunks,
            })
            print(f"  {s.name} width {width}: {res.decode_tok_s:.1f} tok/s (rounds "
                  f"{', '.join(f'{x:.0f}' for x in res.rates)}), TTFT p50 {res.ttft(0.5) * 1000:.0f} ms", flush=True)
        if args.prefix_reps:
            pre = tp.PrefixResult()
            for r in range(args.prefix_reps):
                await tp.prefix_pair(s, client, prompts, args.prefix, str(r), bias, pre)
            result["prefix"] = {"miss": pre.miss, "hit": pre.hit, "prompt_tokens": pre.prompt_tokens,
                                "cached_tokens": pre.cached_tokens}
            print(f"  {s.name} prefix: miss {pre.miss * 1000:.0f} ms, hit {pre.hit * 1000:.0f} ms", flush=True)
    finally:
        await client.close()


def bench_one(variant: str, kind: str, model: Path, prompts: tp.Prompts, args: argparse.Namespace,
              workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"variant": variant, "server": kind, "model": str(model),
                              "weight_bytes": weight_bytes(model), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    s = make_server(kind, model, workdir, args)
    result["argv"] = " ".join(s.argv)
    print(f"{variant} / {kind}: {result['argv']}", flush=True)
    t0 = time.perf_counter()
    try:
        s.start()
        assert s.proc is not None
        with PIDFILE.open("a") as f:
            f.write(f"{s.proc.pid}\n")
        s.wait_ready()
        result["ready_s"] = time.perf_counter() - t0
        print(f"  {kind}: ready in {result['ready_s']:.1f} s", flush=True)
        if kind.startswith("gmlx"):
            result["load_log"] = log_lines(s.log)
            print("\n".join(f"    | {line}" for line in result["load_log"]), flush=True)
        out = args.profile / f"{variant.replace(':', '-')}-{kind}.json" if args.profile else None
        spy = start_profile(s, out, gil=args.profile_gil)
        try:
            asyncio.run(asyncio.wait_for(drive(s, prompts, args, result), args.server_timeout))
        finally:
            stop_profile(spy)
        if kind.startswith("gmlx"):
            later = log_lines(s.log, limit=400)[len(result["load_log"]):]  # (GMLX_STEP_TIMES: a line a summary)
            if later:
                result["run_log"] = later
                print("\n".join(f"    | {line}" for line in later), flush=True)
    except KeyboardInterrupt:  # the call's time ran out: what the server was doing, then stop
        print(f"  {kind} interrupted after {time.perf_counter() - t0:.0f} s\n--- {kind} ({s.status()}), "
              f"last lines of its log:\n{s.tail(40)}", flush=True)
        raise
    except Exception as e:  # noqa: BLE001 (a failed server keeps its row, with the reason; the run goes on)
        result["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"  {kind} FAILED: {result['error']}\n--- {kind} ({s.status()}), last lines of its log:\n"
              f"{s.tail(25)}", flush=True)
    finally:
        s.stop()
        PIDFILE.unlink(missing_ok=True)
    result["total_s"] = time.perf_counter() - t0
    return result


def start_profile(s: tp.Server, out: Path | None, rate: int = 500, native: bool = True,
                  gil: bool = False) -> subprocess.Popen | None:
    """py-spy recording the server from now until ``stop_profile`` (every thread, idle
    samples included: where each thread's wall time goes; with ``gil``, only the thread
    holding the interpreter at each sample: which thread's Python a step waits behind), as
    speedscope JSON in ``out``; None without a path, a process or py-spy."""
    if s.proc is None:
        return None
    return profile_summary.record(s.proc.pid, out, rate, native, gil)


stop_profile = profile_summary.stop


def log_lines(log: Path, limit: int = 60) -> list[str]:
    """The lines of a gmlx server's log that ``LOG_KEYS`` pick (at most ``limit``,
    each cut to 600 characters)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:600] for line in lines
            if any(k in line for k in LOG_KEYS) and "\u2591" not in line][:limit]  # no progress bars


# -- tables -----------------------------------------------------------------------------


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1000:.0f}"


def run_order(label: str) -> tuple[int, int]:
    """Where a run's column goes: its server's place in ``SERVERS``, then its run
    (``gmlx#2`` after ``gmlx``)."""
    kind, _, run = label.partition("#")
    return SERVERS.index(kind), int(run or 1)


DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12}


def card_bandwidth() -> float:
    """The first GPU's datasheet memory bandwidth, by ``nvidia-smi``'s name (the H200's
    where the name is unknown or there is no ``nvidia-smi``)."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return next((bw for card, bw in DATASHEET_BANDWIDTH.items() if card in name), 4.8e12)


def host_speed() -> str:
    """The host's CPU and how fast it hands MLX operations over (``launch_cost.chain_cost``:
    microseconds an operation of a chain of adds, built and evaluated). A one-stream step
    is ~370 operations handed over by the host, so leases on hosts of other speeds serve
    one stream at other rates with the same code (12-03's host: 8.8 us an add, a later
    one 28.8): this says which host a table's numbers came from."""
    from benchmarks.gpu.launch_cost import chain_cost

    name = "?"
    try:
        name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "?")
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores), {chain_cost()[2]:.1f} us an MLX operation built and handed over"


def tables(results: list[dict[str, Any]], args: argparse.Namespace, notes: dict[str, str]) -> str:
    bw = args.bandwidth or card_bandwidth()
    lines: list[str] = []
    out = lines.append
    out(f"# Served speed, {time.strftime('%Y-%m-%d %H:%M')}; device: {notes.get('device', '?')}; "
        f"host: {notes.get('host', '?')}")
    out("")
    out(f"prompt {args.prompt} tokens, output {args.tokens} tokens, {args.rounds} timed rounds per width "
        "(median), greedy, special/partial tokens biased -100; one server at a time.")
    out("decode tok/s = aggregate: tokens after the last stream's first token / (last finish - that moment).")
    out(f"floor = (tok/s / width) x B / BW, B = weight bytes the server's file holds (token embedding "
        f"excluded unless tied; KV reads ignored), BW = {bw / 1e12:.1f} TB/s.")
    by_variant: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_variant.setdefault(r["variant"], {})[r.get("label", r["server"])] = r
    shapes: dict[str, list[str]] = {}
    for v in by_variant:
        shapes.setdefault(v.split(":")[0], []).append(v)
    for shape, variants in shapes.items():
        out("")
        out(f"## {shape}")
        for v in sorted(variants):
            rs = by_variant[v]
            present = sorted(rs, key=run_order)
            out("")
            out(f"### {v}")
            out("")
            for k in present:
                r = rs[k]
                if "skipped" in r:
                    out(f"- {k}: {r['skipped']}")
                    continue
                state = f"**failed**: {r['error']}" if "error" in r else f"ready in {r.get('ready_s', 0):.1f} s"
                out(f"- {k}: `{Path(r['model']).name}`, B = {r['weight_bytes'] / 2**30:.2f} GiB; {state}")
            widths = sorted({w["width"] for r in rs.values() for w in r.get("widths", [])})
            base = [k for k in present if k.startswith("gmlx")]
            peers = [k for k in PEERS if k in present]
            head = ["width"] + [f"{k} tok/s" for k in present]
            head += [f"{b}/{p}" for b in base for p in peers]
            head += [f"{k} TTFT p50/p95 ms" for k in present] + ["floor " + " / ".join(present)]
            out("")
            out("| " + " | ".join(head) + " |")
            out("|---:|" + "---:|" * (len(head) - 1))

            def wres(k: str, width: int, rs: dict[str, dict[str, Any]] = rs) -> dict[str, Any] | None:
                return next((w for w in rs[k].get("widths", []) if w["width"] == width), None)

            def cell(k: str, rs: dict[str, dict[str, Any]] = rs) -> str:
                return rs[k].get("skipped", "failed" if "error" in rs[k] else "—")

            for width in widths:
                row = [str(width)]
                rates = {k: (w["decode_tok_s"] if (w := wres(k, width)) else None) for k in present}
                row += [f"{rates[k]:.1f}" if rates[k] else cell(k) for k in present]
                for b in base:
                    for p in peers:
                        row.append(f"{rates[b] / rates[p]:.2f}" if rates[b] and rates[p] else "—")
                for k in present:
                    w = wres(k, width)
                    row.append(f"{fmt_ms(w['ttft_p50'])} / {fmt_ms(w['ttft_p95'])}" if w else cell(k))
                fr = []
                for k in present:
                    rate = rates[k]
                    x = rate / width * rs[k]["weight_bytes"] / bw if rate else None
                    fr.append("—" if x is None else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}")
                row.append(" / ".join(fr))
                out("| " + " | ".join(row) + " |")
            out("")
            out("| server | ready s | first TTFT ms | second TTFT ms | steady TTFT ms (width 1 p50) | "
                "first / steady | within 2x | prefix miss ms | prefix hit ms | miss / hit | cached on hit |")
            out("|---|" + "---:|" * 10)
            for k in present:
                r = rs[k]
                if "skipped" in r:
                    out(f"| {k} | " + " | ".join([r["skipped"]] * 10) + " |")
                    continue
                w1 = wres(k, 1) if 1 in widths else None
                steady = w1["ttft_p50"] if w1 else None
                first = r.get("first_ttft")
                ratio = first / steady if first and steady else None
                pre = r.get("prefix") or {}
                out("| " + " | ".join([
                    k, f"{r['ready_s']:.1f}" if "ready_s" in r else "—", fmt_ms(first), fmt_ms(r.get("second_ttft")),
                    fmt_ms(steady), f"{ratio:.1f}x" if ratio else "—",
                    ("yes" if ratio <= 2 else "**no**") if ratio else "—",
                    fmt_ms(pre.get("miss")), fmt_ms(pre.get("hit")),
                    f"{pre['miss'] / pre['hit']:.1f}x" if pre else "—", str(pre.get("cached_tokens", "—")),
                ]) + " |")
    return "\n".join(lines) + "\n"


# -- the run ------------------------------------------------------------------------------


def on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3-8b:f16,llama3-8b:q4",
                   help="comma-separated SHAPE:QUANT variants (QUANT: f16, q4, q8)")
    p.add_argument("--shape", help="shorthand for --models SHAPE:f16 (e.g. tiny for a CPU check)")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    p.add_argument("--servers", default="gmlx,mlx_lm,llama", help=f"subset of {','.join(SERVERS)}")
    p.add_argument("--gmlx-mlx", action="store_true", help="also gmlx on the MLX folder")
    p.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[1, 8, 32])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (width runs)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefix", type=int, default=2048, help="shared system-prompt tokens (prefix reuse)")
    p.add_argument("--prefix-reps", type=int, default=2, help="0 skips the prefix-reuse case")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="bytes/s for the floor (default: the card's datasheet figure; H200 4.8e12, H100 SXM 3.35e12)")
    p.add_argument("--server-timeout", type=float, default=480.0, help="seconds per server, after ready")
    p.add_argument("--start-timeout", type=float, default=420.0, help="seconds until a server is ready")
    p.add_argument("--gmlx-args", type=lambda s: s.split(), default=[])
    p.add_argument("--gmlx-home", type=Path,
                   help="one GMLX_HOME for every gmlx server (default: one each, in a temp folder): "
                        "shares the converted-weights cache and the kernel tuning, e.g. with served_step.py's")
    p.add_argument("--peer-args", type=lambda s: s.split(), default=[], help="extra mlx_lm.server flags")
    p.add_argument("--profile", type=Path,
                   help="a folder: each server recorded by py-spy while it is driven (speedscope JSON)")
    p.add_argument("--profile-gil", action="store_true",
                   help="with --profile: only the thread holding the interpreter at each sample (py-spy --gil)")
    p.add_argument("--llama-args", type=lambda s: s.split(), default=[], help="extra llama-server flags")
    p.add_argument("--results", type=Path, default=Path("/tmp/gpu-results"),
                   help="where per-server JSON results accumulate across calls")
    p.add_argument("--fresh", action="store_true", help="forget earlier results first")
    p.add_argument("--out", type=Path, help="also write the tables (markdown) here, e.g. $OUT/bench.md")
    args = p.parse_args()
    if args.shape:
        args.models = f"{args.shape}:f16"
    tp.START_TIMEOUT_S = args.start_timeout
    # SIGTERM (a timeout) unwinds like Ctrl-C, so the running server is stopped.
    signal.signal(signal.SIGTERM, on_sigterm)
    end_leftovers()
    servers = [s for s in args.servers.split(",") if s]
    if args.gmlx_mlx and "gmlx-mlx" not in servers:
        servers.insert(1, "gmlx-mlx")
    if bad := set(servers) - set(SERVERS):
        raise SystemExit(f"unknown servers: {', '.join(sorted(bad))}")

    import mlx.core as mx

    notes: dict[str, str] = {"device": str(mx.default_device())}
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout.strip()
        if gpu:
            notes["device"] += f" ({gpu})"
    except (OSError, subprocess.SubprocessError):
        pass
    notes["host"] = host_speed()
    if args.fresh:
        shutil.rmtree(args.results, ignore_errors=True)
    args.results.mkdir(parents=True, exist_ok=True)
    llama = find_llama_server()

    def load_all() -> list[dict[str, Any]]:
        return [json.loads(f.read_text()) for f in sorted(args.results.glob("*.json"))]

    def publish() -> str:
        text = tables(load_all(), args, notes)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            args.out.with_suffix(".json").write_text(json.dumps(load_all(), indent=1))
        return text

    workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    started = time.perf_counter()
    try:
        for variant in args.models.split(","):
            shape, _, quant = variant.partition(":")
            if quant not in FILES:
                raise SystemExit(f"{variant}: QUANT must be one of {', '.join(FILES)}")
            folder = args.models_dir / shape
            tok = folder / "tokenizer" if (folder / "tokenizer").exists() else folder / "mlx-bf16"
            prompts = tp.Prompts(tok)
            runs: dict[str, int] = {}
            for kind in servers:
                runs[kind] = runs.get(kind, 0) + 1
                label = kind if runs[kind] == 1 else f"{kind}#{runs[kind]}"
                name = FILES[quant][kind]
                if name is None:
                    continue
                model = folder / name
                skipped = ("not built" if kind == "llama" and llama is None
                           else f"no {name}" if not model.exists() else None)
                if skipped:
                    # llama-server: not at /tmp/llama/build/bin, $LLAMA_SERVER or on PATH
                    print(f"{variant}/{kind}: skipped, {skipped}", flush=True)
                    result = {"variant": variant, "server": kind, "model": str(model), "skipped": skipped}
                else:
                    result = bench_one(variant, kind, model, prompts, args, workdir)
                result["label"] = label
                (args.results / f"{shape}_{quant}_{label}.json").write_text(json.dumps(result, indent=1))
                publish()
        print()
        print(publish())
        print(f"benchmarked in {time.perf_counter() - started:.0f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
