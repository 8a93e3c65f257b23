#!/usr/bin/env bash
# Runs THERE (the H200 machine), from the repo root, as one device call after the parts
# are staged (README.md, "The next lease"): installs if needed, then runs the decode
# step's diagnostics one after another, each cut off at what is left of one time budget
# so the call ends with its files written and the kernel cache packed for the next lease.
#
#   bash benchmarks/gpu/diagnose.sh OUTDIR [BUDGET_S]
#
# OUTDIR gets one .txt per step (and mlx-ptx.tar.gz); BUDGET_S (default 540, under the
# 600 s a call may run) is shared by the steps in order; each gets at most its own cap.
set -uo pipefail

OUT=${1:?usage: diagnose.sh OUTDIR [BUDGET_S]}
BUDGET=${2:-540}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
START=$SECONDS
RESERVE=20  # for packing the kernel cache at the end

[ -f /tmp/gpu-env.sh ] || bash benchmarks/gpu/setup.sh install > "$OUT/install.txt" 2>&1 \
  || { tail -5 "$OUT/install.txt"; exit 1; }
# shellcheck disable=SC1091
. /tmp/gpu-env.sh
export PYTHONPATH=$ROOT:$PYTHONPATH

# run NAME CAP_S COMMAND...: COMMAND's output into OUTDIR/NAME.txt, cut off at CAP_S or at
# what is left of the budget, whichever comes first; a step with under 30 s left is skipped
run() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - RESERVE - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 30 ]; then echo "== $name: skipped (${left}s left)"; return; fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0))s (limit ${limit}s)"
  tail -n 40 "$OUT/$name.txt"
}

# first what compiles every kernel a step uses (a fresh machine's first 8B process spends
# 2-3 minutes in MLX's compiles without a kernel cache from a past lease), then the profile:
# every kernel's start and end by PyTorch's profiler (no replay: the GPU's busy time and the
# gaps between kernels), then ncu's times alone, one step a width (with the DRAM and SM
# metrics ncu replays each of a step's ~600 kernels several times: 2 steps at 3 widths ran
# past 230 s on 12-03)
run pipeline 170 python3 benchmarks/gpu/pipeline_check.py synthetic:llama3-8b --widths 1,8 --no-generator \
  --loops "one token,step kernels,one token,step kernels"
run kernel_trace 130 python3 benchmarks/gpu/kernel_times.py synthetic:llama3-8b --widths 1,8,32 \
  --loops "one token,step kernels" --steps 8 --trace
run kernel_times 220 python3 benchmarks/gpu/kernel_times.py synthetic:llama3-8b --widths 1,8,32 \
  --loops "one token" --steps 1 --time-only --limit 150
bash benchmarks/gpu/setup.sh kernels "$OUT"
echo "diagnose.sh: done in $((SECONDS - START))s"
