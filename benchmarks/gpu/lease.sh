#!/usr/bin/env bash
# Runs THERE (the accelerator machine), from the repo root: one lease's measurement of issue
# 19 as a few named calls, each a device call of its own (the machine goes cold ~30 s
# after a call, so the next is ready to send before this one returns). Results go under
# $OUT (each call's own files) and /tmp/gpu-results* (bench.py's tables, across calls).
#
#   call 1, carry [".gpu/part1"]:              bash benchmarks/gpu/lease.sh start
#   call 2, carry [".gpu/part2"]:              bash benchmarks/gpu/lease.sh part2
#   call 3, carry [".gpu/part3", ".gpu/ptx"]:  bash benchmarks/gpu/lease.sh prepare   (~320 s)
#   or gmlx alone (LLAMA=0 at start):          DIRECT=1 CHECKS=0 bash benchmarks/gpu/lease.sh prepare (~60 s)
#   or, no models (a short lease):             bash benchmarks/gpu/lease.sh install && bash benchmarks/gpu/lease.sh asynccheck
#   call 4:                                    bash benchmarks/gpu/lease.sh gmlx      (~140-400 s)
#   call 5:                                    bash benchmarks/gpu/lease.sh trace     (~300 s)
#   call 6:                                    bash benchmarks/gpu/lease.sh long      (~180 s)
#   call 7 (if budget is left):                bash benchmarks/gpu/lease.sh pairs     (~250 s)
#   the attention's fixed cost under ncu:      bash benchmarks/gpu/lease.sh ncu-attention (~120 s)
#   the rope folded into the attention:        bash benchmarks/gpu/lease.sh fold      (~450 s)
#   the attention's code shorter:              bash benchmarks/gpu/lease.sh compact   (~400 s)
#   settings by the served step's GPU time:    bash benchmarks/gpu/lease.sh variants  (~300-400 s)
#   where the served step's host time goes:    bash benchmarks/gpu/lease.sh host      (~450 s)
#   point 3 on an H200 (kind nvidia-h200):    bash benchmarks/gpu/lease.sh h200      (~250 s)
#   MLX's graph commits on a host-paced step: bash benchmarks/gpu/lease.sh h200host  (~350 s)
#   point 4 again (served and in process):    bash benchmarks/gpu/lease.sh point4    (~550 s)
#   the products' stall reasons under ncu:    bash benchmarks/gpu/lease.sh ncu-products (~300 s)
#   launch shapes by the device's time alone:  bash benchmarks/gpu/lease.sh shapes    (~300 s)
#   the products' K split between warps:       bash benchmarks/gpu/lease.sh split     (~500 s)
#   the split shapes' agreement and times:     bash benchmarks/gpu/lease.sh splitcheck (~120 s)
#   the weights streamed through shared memory: bash benchmarks/gpu/lease.sh async   (~500 s)
#   their agreement and times, each shape:     bash benchmarks/gpu/lease.sh asynccheck (~150 s)
#   the normed gate-up's sources under ncu:     bash benchmarks/gpu/lease.sh ncu-gemv  (~200 s, no models)
#   the normed products, x prepared or not:    bash benchmarks/gpu/lease.sh preparedcheck (~150 s, no models)
#   the normed products' x prepared, served:   bash benchmarks/gpu/lease.sh prepared  (~500 s)
#   x rounded to bytes, agreement and times:    bash benchmarks/gpu/lease.sh q8check   (~200 s, no models)
#   the next weights fetched into L2 meanwhile: bash benchmarks/gpu/lease.sh prefetch  (~150 s, no models)
#   the forms not on by default, device-timed:  bash benchmarks/gpu/lease.sh candcheck (~300 s, no models)
#   the rounded products deeper, by ncu:        GMLX_Q8_DEPTH=1 bash benchmarks/gpu/lease.sh ncu-times (~100 s, no models)
#   K split between warps, x rounded, by ncu:  bash benchmarks/gpu/lease.sh ncu-split (~350 s, no models)
#   bytes in flight both ways, in process:     bash benchmarks/gpu/lease.sh inflight  (~500 s, no models; start with LLAMA=0)
#   the attention's call taken apart:          bash benchmarks/gpu/lease.sh wide      (~250 s, no models)
#   the greedy argmax kernel in the step:       bash benchmarks/gpu/lease.sh argmax    (~450 s, no models)
#   the wide attention's rope under ncu:       bash benchmarks/gpu/lease.sh ncu-wide  (~200-300 s, no models)
#   a kernel boundary against a grid barrier:  bash benchmarks/gpu/lease.sh barrier   (~60 s, no models)
#   a step's few-byte arrays, host and GPU:    bash benchmarks/gpu/lease.sh scalars   (~30 s, no models)
#   a step's primitives, its hand-over native: bash benchmarks/gpu/lease.sh census    (~150-450 s, no models)
#   one stream at a decode batch of 32 and 1:  bash benchmarks/gpu/lease.sh batch     (~400 s, after gmlx)
#   who holds the interpreter, one stream:      bash benchmarks/gpu/lease.sh gil       (~200 s, after gmlx)
#   kernel sources included against inline:   bash benchmarks/gpu/lease.sh include   (~450 s, after gmlx)
#   q/k/v and gate/up weights stacked, served: bash benchmarks/gpu/lease.sh stacked   (~400 s, after gmlx)
#   the float sums against x rounded, served:   bash benchmarks/gpu/lease.sh q8        (~500 s)
#   or, to find what slowed one stream (12-06): bash benchmarks/gpu/lease.sh all1206   (~350 s)
#                                              bash benchmarks/gpu/lease.sh bisect    (~550 s)
#
# start: the GPU's name, part 1 staged, llama.cpp's build started in the background.
# prepare: part 3 and the kernel cache staged, the wheels installed, the kernel checks
#   (attention_check --cached; gemv_check's one-row products, plain, gated and q-k-v, at every
#   launch shape: gemv.txt), the 8B's F16 GGUF, the build waited
#   for, the Q4_K_M quantized, the F16 removed, llama-server served at widths 1, 8, 32.
# gmlx: gmlx served the same way (its first load converts and tunes), then the kernel
#   cache packed into $OUT/mlx-ptx.tar.gz (copy it into .gpu/ptx/ here, or over
#   benchmarks/gpu/kernels/mlx-ptx.tar.gz to keep it for later checkouts) and the load's
#   tuning into $OUT/mlx-*.json (copy it into benchmarks/gpu/kernels/tunings/: `install` and
#   `prepare` put the one of the same card where the next lease's first load reads it;
#   TUNING=0 leaves it out, for a first load that tunes everything).
# trace: every kernel of the served step (the load's tuning from gmlx's run, the whole step
#   over the in-place attention) at widths 1 and 8, traced by PyTorch's profiler; then one
#   stream's kernels under ncu (each kind's DRAM and SM throughput in % of peak).
# long: a 7,800-token prompt at one stream, llama-server and gmlx.
# all1206: the four 12-06 additions (off by default) together against gmlx, widths 1 and 32.
# bisect: one stream served with each of them alone (gmlx-hsplit, -shapes, -staged, -chain),
#   gmlx first and last.
# fold: the rope folded into the in-place attention (gmlx-fold), and that with the add-norm
#   kernel (gmlx-fused), against gmlx, alternating, at widths 1 and 32.
# compact: the in-place attention's builds served: both paths (gmlx-strided: the default
#   before 12-06 midday) and 4 keys in flight (gmlx-compact) against gmlx (dense rows
#   alone), at widths 1 and 32.
# (12-06 evening: gmlx-nowide and gmlx-noresidual were the default pair; both measured)
# variants: the served one-stream step traced in process, a process a setting, alternating
#   at 1 and 8 streams: ms a step, the GPU's busy time, the kernels' sum and count; the
#   medians against gmlx's. By default the defaults against the newest one turned off
#   (gmlx-nofold: the norm before each MLP in MLX's kernel again; ~200 s); then the candidates:
#   VARIANTS=gmlx,gmlx-qkv,gmlx-fold,gmlx-ops200 bash benchmarks/gpu/lease.sh variants (~400 s).
# host: the served step's phases (GMLX_STEP_TIMES: build, hand over, wait, read, between) at
#   widths 1 and 8 through the server, the defaults against 112 kernels a step fewer
#   (gmlx-fewer-steptimes: the q-k-v product and the folded rope) and ~190 fewer
#   (gmlx-fewest-steptimes: and the norm before the attention in the q-k-v product), then in process (served_step.py --modes served:
#   the waited step, the pipelined bare loop and the worker on the layers a server's load
#   leaves): why one stream served 4.29 ms a token where the bare loop took 3.40 (12-06
#   evening, H100)
# pairs: alternating width-1 runs of gmlx and llama-server, and gmlx-nocached against
#   gmlx at widths 8 and 32.
set -uo pipefail

OUT=${OUT:-/tmp/lease-out}
mkdir -p "$OUT"
GPU=benchmarks/gpu
BENCH=(python3 $GPU/bench.py --models llama3-8b:q4 --start-timeout 540 --gmlx-home /tmp/gmlx-home)

stage_kernels() {
  # MLX's kernel cache of an earlier lease: .gpu/ptx where carried, else the one kept in the
  # repository (benchmarks/gpu/kernels/: a new checkout has no .gpu/; it travels with every
  # call's tree); setup.sh install unpacks it where its MLX is the one installed
  if [ -d .gpu/ptx ]; then bash $GPU/setup.sh stage .gpu/ptx
  elif [ -f $GPU/kernels/mlx-ptx.tar.gz ]; then bash $GPU/setup.sh stage $GPU/kernels
  fi
}

take_tuning() {
  # the load-time tuning an earlier lease kept for this card, MLX and format
  # (benchmarks/gpu/kernels/tunings/, tunings.py): the first load then times nothing it
  # timed before (~440 s of an H100 lease, 12-07). TUNING=0: a first load that tunes all.
  with_env
  [ "${TUNING:-1}" = 0 ] || python3 $GPU/tunings.py take /tmp/gmlx-home
}

with_env() {
  # shellcheck disable=SC1091
  . /tmp/gpu-env.sh
  export PYTHONPATH=$PWD:${PYTHONPATH:-} MLX_PTX_CACHE_DIR=/tmp/mlx-ptx PYTHONUNBUFFERED=1  # a timed-out run keeps its output
}

case ${1:-} in
  start)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # the host: a one-stream step is partly the host's, so leases are compared with it in view
    echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; python loop:" \
      "$(python3 -c 'import time; t = time.perf_counter(); sum(i * i for i in range(3_000_000)); print(f"{time.perf_counter() - t:.3f} s")')"
    # LLAMA=0: no llama.cpp build (a lease of in-process checks alone: its 16 jobs slow the host)
    bash $GPU/setup.sh stage .gpu/part1 && { [ "${LLAMA:-1}" = 0 ] || nice -n 19 bash $GPU/setup.sh llama --background; }
    ;;
  part2)
    bash $GPU/setup.sh stage .gpu/part2 && bash $GPU/setup.sh status
    ;;
  install)
    # part 3 and the kernel cache staged and the wheels installed, no models: enough for the
    # in-process checks (gemv_check, attention_check) in a short lease
    bash $GPU/setup.sh stage .gpu/part3 && stage_kernels || exit 1
    bash $GPU/setup.sh install > "$OUT/install.txt" 2>&1 || { tail -20 "$OUT/install.txt"; exit 1; }
    take_tuning
    ;;
  prepare)
    # the kernel cache of an earlier lease, where this checkout has one (else gmlx's first load compiles all)
    bash $GPU/setup.sh stage .gpu/part3 && stage_kernels || exit 1
    bash $GPU/setup.sh install > "$OUT/install.txt" 2>&1 || { tail -20 "$OUT/install.txt"; exit 1; }
    take_tuning
    if [ "${CHECKS:-1}" = 1 ]; then  # CHECKS=0 leaves them to the load's own timings (a short lease)
      timeout 120 python3 $GPU/attention_check.py --cached > "$OUT/attention.txt" 2>&1
      # the one-row products at every launch shape, x staged or not (each compiled here is one
      # the load finds in the kernel cache): the plain products, the gated and the q-k-v ones
      { timeout 150 python3 $GPU/gemv_check.py --reps 30; timeout 60 python3 $GPU/gemv_check.py --gated --reps 30
        timeout 60 python3 $GPU/gemv_check.py --qkv --reps 30; } > "$OUT/gemv.txt" 2>&1
    fi
    if [ "${DIRECT:-0}" = 1 ]; then
      # DIRECT=1 (with LLAMA=0 at start): the Q4_K_M written straight from random blocks in
      # llama-quantize's layout (models.py --direct, ~20 s), no llama.cpp build and no
      # llama-server: a lease for gmlx's own numbers (one stream's share of the floor)
      python3 $GPU/models.py --shape llama3-8b --only gguf-q4_k_m --direct 2>&1 | tail -3
      exit 0
    fi
    python3 $GPU/models.py --shape llama3-8b --only gguf-f16 2>&1 | tail -2
    bash $GPU/setup.sh llama --wait 2>&1 | tail -2
    python3 $GPU/models.py --shape llama3-8b --quantize /tmp/llama/build/bin/llama-quantize \
      --only gguf-q4_k_m 2>&1 | tail -2
    rm -f /tmp/models/llama3-8b/*f16.gguf
    if [ "${LLAMA:-1}" = 1 ]; then  # LLAMA=0: no llama-server run (a lease comparing gmlx's settings alone)
      "${BENCH[@]}" --servers llama --widths 1,8,32 --rounds 2 --prefix-reps 1 --out "$OUT/bench.md" \
        > "$OUT/bench-llama.txt" 2>&1
    fi
    cat "$OUT/attention.txt" "$OUT/gemv.txt" 2>/dev/null; tail -8 "$OUT/bench.md" 2>/dev/null
    ;;
  gmlx)
    with_env
    "${BENCH[@]}" --servers gmlx --widths 1,8,32 --rounds 2 --prefix-reps 1 --out "$OUT/bench.md" \
      > "$OUT/bench-gmlx.txt" 2>&1
    grep -E "whole steps of|launch shape|decode-sized paths|folded into their kernel|runs uncompiled|NotWhole|Traceback" "$OUT/bench-gmlx.txt" | cut -c1-400 | head -28
    # the load's attention timing (layouts, where a split pays), from the load's log in the results
    grep -o '"[^"]*in-place attention[^"]*"' "$OUT/bench.json" | head -8
    bash $GPU/setup.sh kernels "$OUT" | tail -1
    python3 $GPU/tunings.py keep /tmp/gmlx-home "$OUT"  # (copy it into benchmarks/gpu/kernels/tunings/ here)
    # whether MLX keeps gmlx's own kernels on disk too (12-07: its cache held 65 files, none of
    # them gmlx's, so every process compiles them again: part of each load's time)
    echo "gmlx's kernels in MLX's cache: $(ls /tmp/mlx-ptx 2>/dev/null | grep -c '^custom_kernel') files"
    tail -14 "$OUT/bench.md"
    ;;
  trace)
    with_env
    GMLX_HOME=/tmp/gmlx-home timeout 240 python3 $GPU/kernel_times.py /tmp/models/llama3-8b/q4_k_m.gguf --widths "${WIDTHS:-1,8}" \
      --loops served --steps 8 --trace --dtype float16 > "$OUT/trace.txt" 2>&1
    grep -v "^served:" "$OUT/trace.txt" | tail -60
    # one stream's kernels under ncu: each kernel's DRAM and SM throughput (% of peak) in the served step
    GMLX_HOME=/tmp/gmlx-home timeout 300 python3 $GPU/kernel_times.py /tmp/models/llama3-8b/q4_k_m.gguf --widths 1 \
      --loops served --steps 2 --dtype float16 --no-plain --limit "${NCU_LIMIT:-240}" \
      --ncu "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" > "$OUT/ncu.txt" 2>&1
    grep -v "^served:" "$OUT/ncu.txt" | tail -30
    ;;
  bisect)
    # one stream served with each of the 12-06 additions (off by default) taken one at a time,
    # gmlx itself first and last: which one cost the 12-06 H100 lease its one-stream speed
    # (gmlx-chain and gmlx-staged tune their products again: ~100 s of load each)
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-bisect --servers gmlx,gmlx-hsplit,gmlx-shapes,gmlx-staged,gmlx-chain,gmlx \
      --widths 1 --rounds 2 --prefix-reps 0 --out "$OUT/bisect.md" > "$OUT/bisect.txt" 2>&1
    grep -E "uncompiled|WARNING|tok/s" "$OUT/bisect.txt" | cut -c1-300 | head -30
    ;;
  all1206)
    # all four 12-06 additions at once against the defaults, at one stream and 32
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-all1206 --servers gmlx-all1206,gmlx --widths 1,32 --rounds 2 \
      --prefix-reps 0 --out "$OUT/all1206.md" > "$OUT/all1206.txt" 2>&1
    grep -E "decode-sized|uncompiled|tok/s" "$OUT/all1206.txt" | cut -c1-600 | head -12
    ;;
  fold)
    # fewer operations a step: the rope inside the in-place attention (one a layer fewer),
    # with the add-norm kernel too (two more), alternating with the defaults; the load
    # checks the folded kernel against MLX's rope and attention (a warning where it keeps
    # MLX's rope)
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-fold --servers gmlx-fold,gmlx,gmlx-fused,gmlx-fold --widths 1,32 \
      --rounds 2 --prefix-reps 0 --out "$OUT/fold.md" > "$OUT/fold.txt" 2>&1
    grep -E "rope|uncompiled|WARNING|tok/s" "$OUT/fold.txt" | cut -c1-300 | head -20
    tail -8 "$OUT/fold.md"
    ;;
  compact)
    # the attention's builds served (the load checks and times each as it is built): the
    # dense rows' build (the default) against both paths and against fewer keys in flight
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-compact --servers gmlx-strided,gmlx,gmlx-compact,gmlx-strided \
      --widths 1,32 --rounds 2 --prefix-reps 0 --out "$OUT/compact.md" > "$OUT/compact.txt" 2>&1
    grep -E "in-place|uncompiled|WARNING|tok/s" "$OUT/compact.txt" | cut -c1-300 | head -20
    tail -8 "$OUT/compact.md"
    ;;
  ncu-attention)
    # why the in-place attention costs ~17 us a call whatever its keys (12-06 H100: 23.4 us
    # a layer in the traced step at ~130 positions; 20 us at 38 keys, 33 at 256, chained):
    # a few of its launches under ncu's sections (the SMs' and memory's speed of light, the
    # warps' stall reasons, the launch and occupancy), the attention_check run kept short
    # first the call taken apart, chained (over no keys; a launch reading the positions only)
    with_env
    timeout 120 python3 $GPU/attention_check.py --fixed > "$OUT/fixed.txt" 2>&1; tail -24 "$OUT/fixed.txt"
    # (MLX's CUDA graphs off for ncu: an earlier ncu pass over attention_check profiled no kernel)
    MLX_USE_CUDA_GRAPHS=0 timeout 240 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --kernel-name regex:attend_cached \
      --launch-skip 40 --launch-count 4 --section SpeedOfLight --section WarpStateStats --section LaunchStats \
      --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters \
      python3 $GPU/attention_check.py --cached --reps 20 \
      > "$OUT/ncu-attention.txt" 2>&1
    grep -E "attend_cached|Duration|Stall|Warp Cycles|Registers|Shared Memory|Achieved|Throughput|==PROF==|==ERROR==" \
      "$OUT/ncu-attention.txt" | cut -c1-200 | head -60
    ;;
  steps)
    # (carry [".gpu/part3", ".gpu/ptx"] after part1 and part2 staged without llama.cpp's build;
    # ~900 s in all: two calls' worth, or run the long_steps lines as separate calls)
    # one stream's step in process, no llama.cpp and no GGUF (the synthetic 8B in Q4_K_M's
    # layouts, long_steps' worker round): as it is, then with all four 12-06 additions; each
    # load tunes what is not yet kept
    bash $GPU/setup.sh stage .gpu/part3 && stage_kernels || exit 1
    bash $GPU/setup.sh install > "$OUT/install.txt" 2>&1 || { tail -20 "$OUT/install.txt"; exit 1; }
    with_env
    export GMLX_HOME=/tmp/gmlx-home
    # the first load draws the 8B's weights and tunes every product: over 250 s on the H100
    LS=(python3 $GPU/long_steps.py synthetic:llama3-8b --lengths 128 --variants served --served --tokens 128)
    timeout 400 "${LS[@]}" > "$OUT/steps-default.txt" 2>&1; grep -E "^served|ms a step|notes|^ +128" "$OUT/steps-default.txt" | cut -c1-900
    GMLX_HEAD_SPLIT=1 GMLX_PRODUCT_TIMING=chain GMLX_STAGED=1 GMLX_STEP_SHAPES=1 timeout 400 "${LS[@]}" \
      > "$OUT/steps-all1206.txt" 2>&1
    grep -E "^served|^ +128|notes" "$OUT/steps-all1206.txt" | cut -c1-900
    ;;
  long)
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-long --servers llama,gmlx --widths 1 --prompt 7800 --tokens 128 \
      --rounds 1 --prefix-reps 0 --out "$OUT/long.md" > "$OUT/long.txt" 2>&1
    tail -10 "$OUT/long.md"
    ;;
  variants)
    # settings compared by the served one-stream step's own GPU time (step_variants.py: each
    # in a process of its own, alternating, the step traced; the load's tuning read from
    # /tmp/gmlx-home, so after `gmlx`): served tok/s moved 199-262 between processes of one
    # build on 12-06, too much to show a few percent
    with_env
    GMLX_HOME=/tmp/gmlx-home timeout 570 python3 $GPU/step_variants.py /tmp/models/llama3-8b/q4_k_m.gguf --variants "${VARIANTS:-gmlx,gmlx-nofold}" \
      --rounds "${ROUNDS:-2}" --widths 1,8 --keep "$OUT/variants" > "$OUT/variants.txt" 2>&1
    cat "$OUT/variants.txt"
    ;;
  host)
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-host --servers gmlx-steptimes,gmlx-fewer-steptimes,gmlx-fewest-steptimes,gmlx-steptimes \
      --widths 1,8 --rounds 2 --prefix-reps 0 --out "$OUT/host.md" > "$OUT/host.txt" 2>&1
    grep -E "decode steps of|tok/s|steptimes" "$OUT/host.txt" | cut -c1-400 | head -40
    GMLX_HOME=/tmp/gmlx-home GMLX_STEP_TIMES=128 timeout 300 python3 $GPU/served_step.py /tmp/models/llama3-8b/q4_k_m.gguf \
      --modes served --widths 1,8,32 --tokens 256 --prefix 0 --bias 0 --dtype float16 > "$OUT/served-step.txt" 2>&1
    grep -vE "^ *\| (cuda|q4_k_m)" "$OUT/served-step.txt" | cut -c1-300 | tail -20
    ;;
  h200)
    # point 3 where the issue set it (an H200: its floor at 4.8 TB/s): the defaults, phases
    # logged, beside llama-server's run from `prepare` (its results copied in); the kernel
    # cache packed
    with_env
    mkdir -p /tmp/gpu-results-h200 && cp /tmp/gpu-results/*_llama.json /tmp/gpu-results-h200/ 2>/dev/null
    "${BENCH[@]}" --results /tmp/gpu-results-h200 --servers gmlx-steptimes \
      --widths 1,8,32 --rounds 2 --prefix-reps 1 --out "$OUT/h200.md" > "$OUT/h200.txt" 2>&1
    grep -E "decode steps of (1|8|32) .*the last 12|tok/s \(|norm folded into .*: (taken|disagrees)|launch shape" "$OUT/h200.txt" | cut -c1-300 | head -40
    bash $GPU/setup.sh kernels "$OUT" | tail -1
    tail -14 "$OUT/h200.md"
    ;;
  ncu-products)
    # why the served one-stream step's products read at 0.3-1.8 TB/s of the H200's 4.8 (12-06
    # night: the GPU busy 99% of the step; the 6-bit output layer alone at 3.5): each kind
    # of one-row product and the attention in the served step under ncu's sections (the
    # load's tuning read from /tmp/gmlx-home, so after `gmlx` or `h200`); the launches of
    # one step are ~168, and a step's first five are one of each kind (the q-k-v, the attention,
    # the o-projection, the gate-up-swiglu, the down): each takes ncu ~40 s of replays (20
    # passes), and its report prints only when the run ends, so a run cut off at --limit
    # prints none (12-07 00:30, H100: 24 launches ran past 400 s and gave nothing)
    with_env
    GMLX_HOME=/tmp/gmlx-home timeout 420 python3 $GPU/kernel_times.py /tmp/models/llama3-8b/q4_k_m.gguf --widths 1 \
      --loops served --steps 1 --dtype float16 --no-plain --sections "${LAUNCHES:-5}" --limit 420 \
      --ncu "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" > "$OUT/ncu-products.txt" 2>&1
    grep -E "gmlx_|Duration|DRAM Throughput|Memory Throughput|Stall|stalled|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|No Eligible|Executed Ipc|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Waves Per SM|==PROF==|==ERROR==" \
      "$OUT/ncu-products.txt" | cut -c1-220 | head -150
    ;;
  ncu-gemv)
    # no models needed (after `install`): the normed gate-up-swiglu product (the 8B's, 4-bit,
    # one row) under ncu's sections in gemv_check's process, one launch of each kernel named in
    # KERNELS (by default the served shape 4x4, x made by each warp, and the same with x
    # prepared once a block, and streamed at 4x2 with 4 rounds): the warps' stall reasons,
    # issue slots, occupancy and bytes in flight
    with_env
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for k in ${KERNELS:-gmlx_qglun_half_4_32_4_4_1_[0-9a-f] gmlx_qglun_half_4_32_4_4_1_p_ gmlx_qglun_half_4_32_4_2_1_a4_}; do
      echo "== $k"
      GMLX_ASYNC=1 timeout 200 "$ncu" --clock-control none --kernel-name "regex:$k" --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        --section LaunchStats --section Occupancy python3 $GPU/gemv_check.py --normed --reps 2 2>&1
    done > "$OUT/ncu-gemv.txt" 2>&1
    grep -E "^== |gmlx_|Duration|DRAM Throughput|Memory Throughput|Stall|stalled|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|No Eligible|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM|Shared Memory|==PROF==|==ERROR==" \
      "$OUT/ncu-gemv.txt" | cut -c1-220 | head -120
    ;;
  ncu-times)
    # no models needed (after `install`): every launch of the normed gate-up's kernels at 4 warps
    # (x made by each warp, prepared once a block, deeper, streamed) in gemv_check --normed,
    # timed by the GPU alone (ncu's gpu__time_duration, one pass a launch; the chain's clock of
    # preparedcheck is the host's on a slow host): the median us of each kernel. CHECK: other
    # gemv_check arguments (the plain products: CHECK="--shapes 14336x4096x4,4096x4096x4"
    # KERNELS="qgemv_half"; with GMLX_SPLIT_K=1 their K-split shapes, x rounded, among them)
    with_env
    GMLX_ASYNC=1 timeout "${LIMIT:-230}" "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --clock-control none \
      --kernel-name "regex:${KERNELS:-qglun_half_4_32_4_}" --metrics gpu__time_duration.sum --csv \
      python3 $GPU/gemv_check.py ${CHECK:---normed} --reps "${REPS:-10}" > "$OUT/ncu-times.csv" 2>&1
    python3 - "$OUT/ncu-times.csv" <<'PY'
import csv, re, statistics, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, times = rows[0], {}
for r in rows[1:]:
    d = dict(zip(head, r))
    name = re.sub(r"_[0-9a-f]{12}.*", "", re.sub(r"^.*?(gmlx_)", r"\1", d["Kernel Name"]))
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3}.get(d["Metric Unit"], 1e-3)
    times.setdefault(name, []).append(float(d["Metric Value"].replace(",", "")) * scale)
for name, t in sorted(times.items()):
    print(f"{name}: median {statistics.median(t):.1f} us, min {min(t):.1f}, {len(t)} launches")
PY
    tail -3 "$OUT/ncu-times.csv" | cut -c1-300
    ;;
  inflight)
    # no model file (after `install`; ~450-550 s): the synthetic 8B in Q4_K_M's layouts (random
    # weights, float16) loaded as a server loads it, one stream's served step traced, a process a
    # setting (step_variants.py): the defaults (since 12-07 evening: more chunks a lane in
    # flight, K split between warps, the 6-bit products rounded) against the defaults before
    # (gmlx-noinflight). Each first load tunes its products (~150-250 s); GMLX_HOME keeps that
    # for a second round (ROUNDS=2, ~70 s a run)
    with_env
    GMLX_HOME=/tmp/gmlx-home timeout 575 python3 $GPU/step_variants.py synthetic:llama3-8b --variants "${VARIANTS:-gmlx,gmlx-noinflight}" \
      --rounds "${ROUNDS:-1}" --widths "${WIDTHS:-1}" --timeout 280 --keep "$OUT/inflight" > "$OUT/inflight.txt" 2>&1
    cat "$OUT/inflight.txt"
    grep -h -E "^served:|cut off|Traceback|Error" "$OUT"/inflight/*.txt | cut -c1-900 | head -20
    ;;
  wide)
    # no models needed (after `install`): the in-place attention's call taken apart, the wide
    # form's launch shapes among it (attention_check --fixed, ~60 s; 12-07 15:20 H100: they lose)
    with_env
    # then the same by the device's part alone (each chain behind a lead product): at a short cache
    # the chain's clock is the host's (12-07 evening, H100: the rows asked of L2 ahead lost; removed)
    timeout 200 python3 $GPU/attention_check.py --fixed > "$OUT/fixed.txt" 2>&1; tail -32 "$OUT/fixed.txt" | cut -c1-600
    timeout 250 python3 $GPU/attention_check.py --fixed --device > "$OUT/fixed-device.txt" 2>&1
    tail -32 "$OUT/fixed-device.txt" | cut -c1-600
    ;;
  ncu-wide)
    # no models needed (after `install`; ~200-300 s): why the rope folded into the wide attention
    # costs ~4 us a call (12-07 H100, chained: 10.2 against 14.0 us at 38 keys) and the form
    # ~9 us over an empty launch: the served form (1), the rope in each lane's registers
    # (GMLX_ROPE_LANES, 2) and no rope (3) under ncu's sections (the warps' stall reasons, the
    # instructions, the SMs' and memory's speed of light), two launches each
    with_env
    i=0
    for form in "wide_rope_half_dense_[0-9a-f]{12}" "wide_rope_half_dense_rl" "wide_dense_[0-9a-f]{12}"; do
      i=$((i + 1))
      MLX_USE_CUDA_GRAPHS=0 timeout 100 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" \
        --kernel-name "regex:attend_cached.*${form}" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section LaunchStats --section InstructionStats \
        python3 $GPU/attention_check.py --fixed --reps 5 > "$OUT/ncu-wide-$i.txt" 2>&1
      echo "== $i: $form"
      grep -E "attend_cached|Duration|Stall|Warp Cycles|Registers|Executed Ipc|Instructions|Throughput|==PROF==|==ERROR==" \
        "$OUT/ncu-wide-$i.txt" | cut -c1-160 | head -30
    done
    ;;
  argmax)
    # no models needed (after `install`, or after `gmlx`, whose GMLX_HOME tuning it reuses;
    # ~400-450 s, a first load that tunes every product ~300-350 s of it): the synthetic 8B's
    # served one-stream step traced, a process each (step_variants): gmlx-noargmax (MLX's
    # argmax) then the defaults (the argmax kernel, where the load's check passed: its
    # kernel in the trace's table is gmlx_argmax_*, MLX's is arg_reduce_general)
    with_env
    GMLX_HOME=/tmp/gmlx-home timeout 560 python3 $GPU/step_variants.py synthetic:llama3-8b \
      --variants "${VARIANTS:-gmlx-noargmax,gmlx}" --rounds "${ROUNDS:-1}" --widths "${WIDTHS:-1}" \
      --timeout 400 --keep "$OUT/argmax" > "$OUT/argmax.txt" 2>&1
    cat "$OUT/argmax.txt"
    grep -h -E "argmax|arg_reduce|cut off|Traceback|Error" "$OUT"/argmax/*.txt | cut -c1-300 | head -12
    ;;
  census)
    # no models needed (after `install`, or after `gmlx`, whose GMLX_HOME tuning it reuses; ~150 s
    # with it, ~450 s without): the synthetic 8B's served step counted by primitive (MLX's graph
    # export) at 1 and 8 streams, its build and hand-over timed (step_census.py), then 20 s of one
    # stream's pipelined steps under py-spy --native: where MLX's CUDA backend spends the
    # hand-over (12-07, H100: 165 kernels in 1.70 ms, ~10 us a kernel; call_cost.py: ~3 a call)
    with_env
    # first what one call of each kind costs the host (a view, a kernel of 11 inputs and 3 outputs);
    # COST=0 skips it, LOOP=0 the profiled loop (WIDTHS: the widths counted, 1,8 by default)
    [ "${COST:-1}" = 0 ] || { timeout 90 python3 $GPU/call_cost.py > "$OUT/call_cost.txt" 2>&1; cat "$OUT/call_cost.txt"; }
    GMLX_HOME=/tmp/gmlx-home timeout 560 python3 $GPU/step_census.py synthetic:llama3-8b --widths "${WIDTHS:-1,8}" \
      $([ "${LOOP:-20}" = 0 ] || echo --loop "${LOOP:-20}" --spy "$OUT/native.json") > "$OUT/census.txt" 2>&1
    grep -v "^  |" "$OUT/census.txt" | head -90 | cut -c1-300
    [ -f "$OUT/native.json" ] && python3 $GPU/profile_summary.py "$OUT/native.json" --native --top 30 | cut -c1-3000
    python3 $GPU/tunings.py keep /tmp/gmlx-home "$OUT"  # (where its load tuned: a short lease's)
    ;;
  scalars)
    # no models needed (after `install`; ~30 s): what a step's few-byte arrays cost when the
    # host and the GPU take turns at them (MLX's small pool of read-mostly managed memory: the
    # token read on the host, the write position made there), scalar_check.py
    with_env
    timeout 120 python3 $GPU/scalar_check.py > "$OUT/scalars.txt" 2>&1; tail -12 "$OUT/scalars.txt" | cut -c1-300
    ;;
  barrier)
    # no models needed (after `install`): 32 products of 4096x4096 (4-bit) a launch each, against
    # one launch with a grid barrier between them, with the next product's rows copied before
    # it, and without (barrier_check.py: whether a layer in one kernel is worth building)
    with_env
    timeout 150 python3 $GPU/barrier_check.py > "$OUT/barrier.txt" 2>&1; cat "$OUT/barrier.txt" | cut -c1-400 | tail -20
    timeout 100 python3 $GPU/barrier_check.py --layers 64 2>&1 | tail -8  # (a longer chain: the same per product?)
    ;;
  ncu-split)
    # no models needed (after `install`; ~350 s): K split between a block's warps with x rounded
    # (GMLX_SPLIT_K=1, the 6-bit products rounded too: GMLX_Q8X=all) by ncu's clock, every launch
    # shape beside the unsplit ones: the plain products the 8B's step makes at one row (its 4- and
    # 6-bit down products, the o-projection), then the normed gate-up-swiglu and q-k-v
    export GMLX_SPLIT_K=1 GMLX_Q8X=all
    mkdir -p "$OUT/plain" "$OUT/normed"
    OUT=$OUT/plain LIMIT=${LIMIT:-170} REPS=${REPS:-2} KERNELS=qgemv CHECK="--shapes 14336x4096x4,14336x4096x6,4096x4096x4" \
      bash "$0" ncu-times | head -60
    OUT=$OUT/normed LIMIT=${LIMIT:-170} REPS=${REPS:-2} KERNELS="qglun_half_4_32_|qparts3n_half_4_32_" \
      bash "$0" ncu-times | head -60
    ;;
  q8check)
    # no models needed (after `install`): the normed gate-up-swiglu and q-k-v at each shape,
    # x made by each warp, prepared, rounded to bytes (GMLX_Q8X): agreement and times; then
    # the plain products as loads make them (the 4-bit ones round x); then ncu's GPU time of
    # each normed gate-up kernel at 4 warps (the chain's clock is the host's on a slow host)
    with_env
    { GMLX_ASYNC=1 timeout 150 python3 $GPU/gemv_check.py --normed --reps 30
      timeout 150 python3 $GPU/gemv_check.py --reps 30; } > "$OUT/$1.txt" 2>&1
    cut -c1-1200 "$OUT/$1.txt"
    LIMIT=${LIMIT:-200} REPS=${REPS:-6} KERNELS=${KERNELS:-"qglun_half_4_32_4_|qparts3n_half_4_32_"} bash "$0" ncu-times | head -40
    ;;
  candcheck)
    # no models needed (after `install`): the one-row forms not on by default (K split between
    # warps, weights streamed, the 6-bit products rounded) beside the defaults' shapes, each
    # timed by the device's part alone: the o-proj and down products, then the normed
    # gate-up-swiglu and q-k-v
    with_env
    { GMLX_SPLIT_K=1 GMLX_ASYNC=1 GMLX_Q8X=all timeout 200 python3 $GPU/gemv_check.py --device --reps 20 \
        --shapes 4096x4096x4,14336x4096x4,14336x4096x6
      GMLX_SPLIT_K=1 GMLX_ASYNC=1 timeout 240 python3 $GPU/gemv_check.py --device --normed --reps 20; } > "$OUT/$1.txt" 2>&1
    cut -c1-1500 "$OUT/$1.txt"
    ;;
  prefetch)
    # no models needed (after `install`): 32 layers of the 8B's one-row products with an
    # attention's stand-in that fetches the next products' weights into L2 or not
    with_env
    timeout ${LIMIT:-300} python3 $GPU/prefetch_check.py ${ARGS:-} > "$OUT/$1.txt" 2>&1
    cut -c1-400 "$OUT/$1.txt"
    ;;
  preparedcheck)
    # no models needed (after `install`): the normed gate-up-swiglu and q-k-v products (the
    # 8B's, 4-bit, one row) at each launch shape with the streamed ones, x made by each warp
    # and prepared once a block (GMLX_PREPARED): agreement with MLX's norm then products, times
    with_env
    # (DEVICE=1: timed by the device's part alone, as GMLX_STEP_SHAPES=device tunes, to set beside ncu-times)
    GMLX_ASYNC=1 timeout 240 python3 $GPU/gemv_check.py --normed --reps 30 ${DEVICE:+--device} > "$OUT/$1.txt" 2>&1
    cut -c1-1200 "$OUT/$1.txt"
    ;;
  splitcheck|asynccheck)
    # every one-row launch shape with the K-split ones (GMLX_SPLIT_K=1) or the streamed ones
    # (GMLX_ASYNC=1) among them: whether each agrees with MLX's product and its time, the
    # plain products (the 8B's) and the gated MLP
    with_env
    [ "$1" = asynccheck ] && export GMLX_ASYNC=1 || export GMLX_SPLIT_K=1
    { timeout 200 python3 $GPU/gemv_check.py --reps 30
      timeout 100 python3 $GPU/gemv_check.py --gated --reps 30; } > "$OUT/$1.txt" 2>&1
    cut -c1-900 "$OUT/$1.txt"
    ;;
  shapes|split|async|prepared|q8)
    # shapes: the one-row kernels' launch shapes timed by the device's part alone
    #   (gmlx-deviceshapes: each chain behind a lead product) against the chain's own clock;
    #   the load logs each shape's time both ways
    # split: the one-row products and fused step kernels with K split between a block's warps
    #   (gmlx-splitk: the tuners time those shapes too; ~100 s of load the first time); the
    #   load log's chosen paths (`1:gemv4x4x1x1x0x4`, a sixth number past 1) and launch
    #   shapes say where a split shape won
    # each tuned under keys of its own, against the defaults, alternating at 1 and 8 streams
    with_env
    servers=gmlx-deviceshapes,gmlx,gmlx-deviceshapes,gmlx; [ "$1" = split ] && servers=gmlx-splitk,gmlx,gmlx-splitk,gmlx
    # async: the one-row products' weights streamed through shared memory (gmlx-async; the load
    #   log's paths and launch shapes with a seventh number past 1, e.g. `1:gemv4x2x1x1x0x1x4`,
    #   say where a streamed shape won)
    [ "$1" = async ] && servers=${SERVERS:-gmlx-async,gmlx,gmlx-async,gmlx}
    # prepared: the normed products' x made once a block (gmlx-prepared) against the defaults
    [ "$1" = prepared ] && servers=${SERVERS:-gmlx-prepared,gmlx,gmlx-prepared,gmlx}
    # q8: the 4-bit one-row products' float sums (gmlx-noq8) against the defaults (x rounded to bytes);
    #   the next: SERVERS=gmlx-q8deep,gmlx,gmlx-q8deep,gmlx WIDTHS=1 (more chunks a lane in flight)
    [ "$1" = q8 ] && servers=${SERVERS:-gmlx-noq8,gmlx,gmlx-noq8,gmlx}
    "${BENCH[@]}" --results "/tmp/gpu-results-$1" --servers "$servers" \
      --widths "${WIDTHS:-1,8}" --rounds 2 --prefix-reps 0 --out "$OUT/$1.md" > "$OUT/$1.txt" 2>&1
    grep -E "decode-sized paths|launch shape|tok/s \(" "$OUT/$1.txt" | cut -c1-700 | head -30
    tail -8 "$OUT/$1.md"
    ;;
  batch)
    # (after `gmlx`, from its tuning and kernels; ~400 s) one stream served by a server whose
    # decode batch is 32 (as point 3's table starts it, for widths 1, 8, 32) against one whose
    # decode batch is 1, alternating, phases logged: on the H100 (12-07 evening) the first
    # served one stream at 254.8 tok/s, a second process from its tuning at batch 1 309.0
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-batch --servers "${SERVERS:-gmlx-batch32-steptimes,gmlx-steptimes,gmlx-batch32-steptimes,gmlx-steptimes}" \
      --widths 1 --rounds 2 --prefix-reps 0 --out "$OUT/batch.md" > "$OUT/batch.txt" 2>&1
    grep -E "decode steps of 1 .*the last 12|tok/s \(|ready in|warmed up" "$OUT/batch.txt" | cut -c1-300 | head -40
    tail -8 "$OUT/batch.md"
    ;;
  include)
    # (after `gmlx`, from its tuning; ~450 s) each kernel's source through an #include (the
    # default since 12-08) or inline (GMLX_KERNEL_INCLUDE=0): call_cost.py's 8 KB kernel whole
    # and included (the hash MLX takes of a kernel's source at each evaluation, and whether
    # NVRTC takes the include here), then one stream served both ways, alternating, phases logged
    with_env
    timeout 90 python3 $GPU/call_cost.py > "$OUT/call_cost.txt" 2>&1; cat "$OUT/call_cost.txt"
    "${BENCH[@]}" --results /tmp/gpu-results-include \
      --servers "${SERVERS:-gmlx-steptimes,gmlx-inline-steptimes,gmlx-steptimes,gmlx-inline-steptimes}" \
      --widths 1 --rounds 2 --prefix-reps 0 --out "$OUT/include.md" > "$OUT/include.txt" 2>&1
    grep -E "decode steps of 1 .*the last 12|tok/s \(|ready in|runs uncompiled|Traceback" "$OUT/include.txt" | cut -c1-300 | head -40
    tail -8 "$OUT/include.md"
    ;;
  stacked)
    # (after `gmlx`, from its tuning; ~450 s) a block's q/k/v and gate/up weights stacked at
    # load (GMLX_STACKED=1: the one-row kernels take 5 arrays where they took 11 and 8) and
    # not, one stream served alternating, phases logged: read the hand-over column
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-stacked \
      --servers "${SERVERS:-gmlx-stackedweights-steptimes,gmlx-steptimes,gmlx-stackedweights-steptimes,gmlx-steptimes}" \
      --widths 1 --rounds 2 --prefix-reps 0 --out "$OUT/stacked.md" > "$OUT/stacked.txt" 2>&1
    grep -E "decode steps of 1 .*the last 12|tok/s \(|ready in|stacked into|folded into|Traceback" "$OUT/stacked.txt" \
      | cut -c1-300 | head -40
    tail -8 "$OUT/stacked.md"
    ;;
  gil)
    # (after `gmlx`, from its tuning; ~150 s) which thread holds the interpreter while one stream
    # is served (py-spy --gil, every thread, native frames), then each thread's wall time
    # (--idle): the served step built in 0.86 ms where the worker in process built it in 0.52
    # and handed it over in 2.16 against 1.70 (H100, 12-07 evening)
    with_env
    for mode in gil wall; do
      "${BENCH[@]}" --results /tmp/gpu-results-gil --servers gmlx-steptimes --widths 1 --rounds 1 --prefix-reps 0 \
        --profile "$OUT/spy-$mode" $([ $mode = gil ] && echo --profile-gil) --out "$OUT/gil-$mode.md" > "$OUT/gil-$mode.txt" 2>&1
      grep -E "decode steps of 1 .*the last 12|tok/s \(" "$OUT/gil-$mode.txt" | cut -c1-300 | head -6
      python3 $GPU/profile_summary.py "$OUT"/spy-$mode/*.json --top 10 | cut -c1-200 | head -60
    done
    ;;
  h200host)
    # one stream's host time on the H200: MLX's graph commits none (each kernel launched as
    # encoded) and few (a graph each 400 operations or 16 GB), the two launches of the 6-bit
    # values again (gmlx-nomixed), then the defaults again, phases logged
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-h200host --servers gmlx-nographs-steptimes,gmlx-bigbuffers-steptimes,gmlx-nomixed,gmlx-steptimes \
      --widths 1 --rounds 2 --prefix-reps 0 --out "$OUT/h200host.md" > "$OUT/h200host.txt" 2>&1
    grep -E "decode steps of 1 .*the last 12|tok/s \(" "$OUT/h200host.txt" | cut -c1-300 | head -40
    tail -8 "$OUT/h200host.md"
    ;;
  point4)
    # point 4 on the current defaults: served width 1 against mlx_lm.server, Qwen2.5-1.5B
    # shape, bf16, three alternating runs (the second mlx_lm.server first), then the worker
    # against mlx-lm's BatchGenerator in process on the 8B shape, bf16, at 32 and 1 streams
    with_env
    python3 $GPU/models.py --shape qwen1.5b --only mlx-bf16 2>&1 | tail -1
    for i in 1 2 3; do
      servers=gmlx-mlx,mlx_lm-gmlxenv; [ $i = 2 ] && servers=mlx_lm-gmlxenv,gmlx-mlx
      timeout 170 python3 $GPU/bench.py --models qwen1.5b:f16 --servers $servers --widths 1 --rounds 2 --prefix-reps 2 \
        --start-timeout 150 --results /tmp/p4-$i --out "$OUT/point4-$i.md" > "$OUT/point4-$i.txt" 2>&1
      grep -E "^\| 1 \|" "$OUT/point4-$i.md" | head -1; grep -E "^\| (gmlx-mlx|mlx_lm)" "$OUT/point4-$i.md" | head -2
    done
    timeout 200 python3 $GPU/served_step.py synthetic:llama3-8b --float --modes compiled,plain,plain,plain \
      --widths 32,1 --tokens 256 --prefix 0 > "$OUT/point4-inprocess.txt" 2>&1
    tail -8 "$OUT/point4-inprocess.txt"
    ;;
  pairs)
    with_env
    "${BENCH[@]}" --results /tmp/gpu-results-pairs --servers gmlx,llama,gmlx,llama --widths 1 --rounds 3 --prefix-reps 0 --out "$OUT/pairs.md" \
      > "$OUT/pairs.txt" 2>&1
    tail -8 "$OUT/pairs.md"
    "${BENCH[@]}" --results /tmp/gpu-results-nocached --servers gmlx-nocached,gmlx --widths 8,32 --rounds 2 --prefix-reps 0 --out "$OUT/nocached.md" \
      > "$OUT/nocached.txt" 2>&1
    tail -8 "$OUT/nocached.md"
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | grep '^#'
    exit 2
    ;;
esac
