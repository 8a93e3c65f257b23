#!/usr/bin/env bash
# Runs THERE (the H200 machine, no network), from the repo root. The parts made by
# prepare.sh arrive one device call at a time; /tmp survives between calls while the
# machine stays warm (~30 s after a call), so make the calls back to back.
#
#   benchmarks/gpu/setup.sh stage .gpu/partN   copy a part into /tmp/gpu-stage/
#   benchmarks/gpu/setup.sh install            reassemble mlx-cuda-13, check SHA256SUMS,
#                                              install every wheel into /tmp/site, write
#                                              /tmp/gpu-env.sh, print MLX's default device
#   benchmarks/gpu/setup.sh llama [--background|--wait]
#                                              build llama-server, llama-bench and
#                                              llama-quantize into /tmp/llama/build/bin
#                                              (skipped when built); --background starts
#                                              the build in its own session and returns,
#                                              --wait waits for such a build to end
#   benchmarks/gpu/setup.sh kernels DEST       MLX's compiled-kernel cache of this lease
#                                              (/tmp/mlx-ptx) packed into DEST/mlx-ptx.tar.gz,
#                                              for the next lease to stage beside part3
#   benchmarks/gpu/setup.sh status             what is staged, installed and built
set -euo pipefail

STAGE=${GPU_STAGE:-/tmp/gpu-stage}
SITE=${GPU_SITE:-/tmp/site}
LLAMA=${GPU_LLAMA:-/tmp/llama}
# One compiled-kernel cache for every process of a lease (gmlx servers, mlx_lm.server, the
# scripts), unpacked at install from a past lease's when staged: a fresh machine's first
# 8B process otherwise spends 2-3 minutes compiling MLX's kernels (12-03: >150 s).
PTX=${GPU_PTX:-/tmp/mlx-ptx}
ENVFILE=/tmp/gpu-env.sh
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SCRIPT=$ROOT/benchmarks/gpu/setup.sh

die() { echo "setup.sh: $*" >&2; exit 1; }

stage() {
  local part=${1:?usage: setup.sh stage PARTDIR}
  [ -d "$part" ] || die "no folder $part (was it named in carry?)"
  mkdir -p "$STAGE"
  find "$part" -maxdepth 1 -type f -exec cp -f {} "$STAGE"/ \;  # its files (kernels/ holds tunings/ too)
  echo "staged $part: $(ls "$part" | wc -l) files, $(du -sh "$part" | cut -f1); $STAGE now holds $(du -sh "$STAGE" | cut -f1)"
}

install() {
  cd "$STAGE"
  [ -f SHA256SUMS ] || die "nothing staged in $STAGE"
  local pieces whole
  pieces=$(ls mlx_cuda_13-*.whl.part?? 2>/dev/null || true)
  [ -n "$pieces" ] || die "no mlx-cuda-13 pieces in $STAGE"
  whole=$(echo "$pieces" | head -1); whole=${whole%.part??}
  # shellcheck disable=SC2086
  cat $pieces > "$whole"
  # Every file of every part, and the reassembled wheel: a missing one names the part
  # that was not staged (README.md lists what each part holds).
  if ! sha256sum --quiet -c SHA256SUMS; then
    die "checksums failed or files missing: stage every part first ($(ls "$STAGE" | wc -l) files here)"
  fi
  local nvidia
  nvidia=${NVIDIA_DIR:-$(env -u PYTHONPATH "$PY" -c "import nvidia; print(list(nvidia.__path__)[0])")}
  mkdir -p "$SITE"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$STAGE"/*.whl >/tmp/gpu-pip.log 2>&1; then
    cat /tmp/gpu-pip.log; die "pip install failed"
  fi
  # MLX's CUDA backend finds the CUDA libraries at ../../nvidia/... beside itself.
  ln -sfn "$nvidia" "$SITE/nvidia"
  mkdir -p "$PTX"
  if [ -f "$STAGE/mlx-ptx.tar.gz" ]; then
    # the past lease's cache serves only the MLX it was compiled by
    local want had
    want=$(ls -d "$SITE"/mlx-*.dist-info 2>/dev/null | head -1 || true); want=${want##*/}
    had=$(tar xzf "$STAGE/mlx-ptx.tar.gz" -O ./MLX_VERSION 2>/dev/null || true)
    if [ -n "$want" ] && [ "$had" = "$want" ]; then
      tar xzf "$STAGE/mlx-ptx.tar.gz" -C "$PTX"
      echo "MLX's kernel cache from a past lease: $(find "$PTX" -type f | wc -l) files ($had)"
    else
      echo "MLX's kernel cache staged but made by ${had:-an unknown MLX}, not $want: not used"
    fi
  fi
  cat >"$ENVFILE" <<EOF
# written by benchmarks/gpu/setup.sh install
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$LLAMA/build/bin:$SITE/bin:\$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export GPU_VOCAB=$STAGE/ggml-vocab-llama-bpe.gguf
export MLX_PTX_CACHE_DIR=$PTX
EOF
  # shellcheck disable=SC1090
  . "$ENVFILE"
  cd "$ROOT"
  "$PY" -c "import mlx.core as mx; print(mx.default_device())"
  "$PY" -c "import mlx.core as mx, mlx_lm, gmlx.cli.main, fastapi, uvicorn, openai, gguf, llguidance, transformers; \
print('mlx', mx.__version__, '| mlx_lm', mlx_lm.__version__, '| transformers', transformers.__version__)"
  echo "installed into $SITE; source $ENVFILE"
}

llama_build() {
  local mode=${1:-}
  local src=$LLAMA/src build=$LLAMA/build
  if [ "$mode" = --wait ]; then
    local t=0
    while [ ! -f "$LLAMA/build.rc" ]; do
      [ -f "$LLAMA/build.pid" ] || die "no build started"
      sleep 5; t=$((t + 5))
      if [ $((t % 60)) -eq 0 ]; then echo "waiting for the llama.cpp build (${t}s): $(tail -c 200 "$LLAMA/build.log" | tr '\r\n' '  ' | tail -c 120)"; fi
    done
    tail -n 5 "$LLAMA/build.log"
    [ "$(cat "$LLAMA/build.rc")" = 0 ] || die "llama.cpp build failed; see $LLAMA/build.log"
    ls "$build/bin"
    return
  fi
  if [ "$mode" = --background ]; then
    if [ -f "$LLAMA/build.pid" ] && [ ! -f "$LLAMA/build.rc" ]; then echo "a build is running"; return; fi
    mkdir -p "$LLAMA"; rm -f "$LLAMA/build.rc"
    setsid bash -c "bash '$SCRIPT' llama > '$LLAMA/build.log' 2>&1; echo \$? > '$LLAMA/build.rc'" </dev/null >/dev/null 2>&1 &
    echo $! > "$LLAMA/build.pid"
    echo "llama.cpp build started in the background (pid $(cat "$LLAMA/build.pid"), log $LLAMA/build.log)"
    return
  fi
  if [ -x "$build/bin/llama-server" ] && [ -x "$build/bin/llama-bench" ] && [ -x "$build/bin/llama-quantize" ]; then
    echo "llama.cpp already built in $build/bin"; return
  fi
  if [ ! -f "$src/CMakeLists.txt" ]; then
    [ -f "$STAGE/llama.cpp.tar.gz" ] || die "no $STAGE/llama.cpp.tar.gz (stage part1 first)"
    mkdir -p "$LLAMA"
    tar xzf "$STAGE/llama.cpp.tar.gz" -C "$LLAMA"
    mv "$LLAMA/llama.cpp" "$src"
  fi
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  local cuda=${LLAMA_CUDA:-ON}
  local t0=$SECONDS
  # Offline: no curl/openssl, no web UI download, no tests or examples.
  local flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release
    -DGGML_CUDA="$cuda" -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF)
  # shellcheck disable=SC2206
  flags+=(${LLAMA_CMAKE_EXTRA:-})
  # Up to three tries: a toolkit without cuBLAS or without the driver library's stub
  # gets them from elsewhere (what failed decides).
  local try
  for try in 1 2 3; do
    if cmake -S "$src" -B "$build" "${flags[@]}" >"$LLAMA/cmake.log" 2>&1; then break; fi
    [ "$try" = 3 ] && { tail -n 40 "$LLAMA/cmake.log"; die "cmake failed"; }
    if grep -q "CUDA::cublas" "$LLAMA/cmake.log" && ! grep -q "cublas-shim" <<<"${flags[*]}"; then
      # The pip nvidia-cublas (torch's); its headers through a shim folder, not its whole
      # include/ (which holds other versions of the toolkit's headers).
      local cu=${CUBLAS_ROOT:-$(env -u PYTHONPATH "$PY" -c "import nvidia; print(list(nvidia.__path__)[0])")/cu13}
      local lib lt
      lib=$(ls "$cu"/lib/libcublas.so* 2>/dev/null | head -1); lt=$(ls "$cu"/lib/libcublasLt.so* 2>/dev/null | head -1)
      [ -n "$lib" ] && [ -n "$lt" ] || { tail -n 40 "$LLAMA/cmake.log"; die "no cuBLAS in the toolkit or $cu"; }
      mkdir -p "$LLAMA/cublas-shim"
      ln -sfn "$cu"/include/cublas*.h "$LLAMA/cublas-shim/"
      echo "cuBLAS from $cu"
      flags+=(-DCUDA_cublas_LIBRARY="$lib" -DCUDA_cublasLt_LIBRARY="$lt"
              -DCMAKE_CUDA_FLAGS="-I$LLAMA/cublas-shim" -DCMAKE_CXX_FLAGS="-I$LLAMA/cublas-shim")
    elif grep -q "CUDA::cuda_driver" "$LLAMA/cmake.log" && ! grep -q "cuda_driver_LIBRARY" <<<"${flags[*]}"; then
      local drv=${CUDA_DRIVER_LIB:-$( (ls /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/nvidia/lib64/libcuda.so* \
        /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null; ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF}') | head -1)}
      [ -n "$drv" ] || { tail -n 40 "$LLAMA/cmake.log"; die "no libcuda.so found"; }
      echo "CUDA driver library: $drv"
      flags+=(-DCUDA_cuda_driver_LIBRARY="$drv")
    else
      tail -n 40 "$LLAMA/cmake.log"; die "cmake failed"
    fi
    rm -rf "$build"
  done
  ninja -C "$build" llama-server llama-bench llama-quantize
  echo "llama.cpp built in $((SECONDS - t0)) s: $(ls "$build/bin" | tr '\n' ' ')"
}

kernels() {
  local dest=${1:?usage: setup.sh kernels DEST}
  [ -d "$PTX" ] || die "no kernel cache at $PTX (run install first)"
  local version
  version=$(ls -d "$SITE"/mlx-*.dist-info 2>/dev/null | head -1 || true); version=${version##*/}
  echo "$version" > "$PTX/MLX_VERSION"
  mkdir -p "$dest"
  tar czf "$dest/mlx-ptx.tar.gz" -C "$PTX" .
  echo "packed $(find "$PTX" -type f | wc -l) files ($version) into $dest/mlx-ptx.tar.gz, $(du -sh "$dest/mlx-ptx.tar.gz" | cut -f1)"
}

status() {
  echo "stage: $(ls "$STAGE" 2>/dev/null | wc -l) files, $(du -sh "$STAGE" 2>/dev/null | cut -f1)"
  echo "site: $( [ -d "$SITE/mlx" ] && echo installed || echo absent)"
  echo "llama: $(ls "$LLAMA/build/bin" 2>/dev/null | tr '\n' ' ') rc=$(cat "$LLAMA/build.rc" 2>/dev/null || echo -)"
  df -h /tmp | tail -1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
}

case "${1:-}" in
  stage) stage "${2:-}" ;;
  install) install ;;
  llama) llama_build "${2:-}" ;;
  kernels) kernels "${2:-}" ;;
  status) status ;;
  *) sed -n '2,20p' "$SCRIPT"; exit 2 ;;
esac
