#!/usr/bin/env bash
# Runs HERE (x86-64 Linux with internet), from anywhere in the repo: gathers what the
# offline H200 lacks into .gpu/ (ignored), cut into parts that each fit one device call.
#
#   benchmarks/gpu/prepare.sh            # re-runnable: downloads only what is missing
#
# .gpu/wheels/            Python 3.12 manylinux x86_64 wheels (pinned below) + gmlx's own
# .gpu/llama.cpp.tar.gz   llama.cpp's source (from the llama-cpp-python sdist), trimmed
# .gpu/partN/             hard links to the above, each part < PART_MIB MiB; the
#                         mlx-cuda-13 wheel is split (29M pieces) across parts; every
#                         part holds SHA256SUMS (of every file in every part)
#
# Then, on the device, benchmarks/gpu/setup.sh stages and installs them (README.md).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
G="$ROOT/.gpu"
W="$G/wheels"
PY=${PYTHON:-python3}
[ -x "$ROOT/.venv/bin/python" ] && PY=${PYTHON:-$ROOT/.venv/bin/python}
PART_MIB=${PART_MIB:-54}   # < 55 MiB: the repo's tree (~2 MiB) travels with each part
VOCAB_SRC=${VOCAB_SRC:-$ROOT/../shared/fixtures/vocab/ggml-vocab-llama-bpe.gguf}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
mkdir -p "$W" "$G/dl"

# What gmlx's `serve`, mlx_lm.server and benchmarks/throughput.py import at run time
# (checked with a sys.modules dump of both servers here), pinned to the versions this
# repo's .venv runs, minus what the H200's image already has and we leave to it:
# numpy, transformers, tokenizers, huggingface-hub, safetensors, sentencepiece, protobuf,
# pyyaml, regex, requests, tqdm, filelock, packaging, pillow and the nvidia-* CUDA libraries
# mlx-cuda-13 needs. textual is left out: only `gmlx top` imports it.
PINS=(
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2
  gguf==0.19.0 llguidance==1.9.1
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 h11==0.16.0 click==8.5.1
  typer==0.29.2 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
  prometheus-client==0.26.0 psutil==7.2.2 platformdirs==4.14.9
  httpx==0.28.1 httpcore==1.0.9 anyio==4.16.0 sniffio==1.3.1 idna==3.20 certifi==2026.10.19.post1
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  jinja2==3.1.6 markupsafe==3.0.4
  py-spy==0.4.3
)
PLATFORMS=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)

# -- (a) wheels ------------------------------------------------------------------------
missing=()
shopt -s nocaseglob
for spec in "${PINS[@]}"; do
  name=${spec%%==*}; ver=${spec##*==}
  norm=$(echo "$name" | sed 's/[-.]/_/g')
  compgen -G "$W/${norm}-${ver}-*.whl" >/dev/null || missing+=("$spec")
done
shopt -u nocaseglob
if [ ${#missing[@]} -gt 0 ]; then
  echo "downloading ${#missing[@]} wheels: ${missing[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$W" "${missing[@]}"
else
  echo "wheels: all ${#PINS[@]} present"
fi
# gmlx itself, always rebuilt (the working tree changes). Run from the repo root on the
# device, `python3 -m gmlx...` imports the travelling working tree first anyway; the wheel
# serves runs from elsewhere.
# Built from a copy, so that setuptools leaves no build/ in the repo.
rm -f "$W"/gmlx-*.whl
tmp=$(mktemp -d)
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/gmlx" "$tmp/"
find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps "$tmp" -w "$W"
rm -rf "$tmp"

# Every non-extra Requires-Dist must be carried or already on the H200.
"$PY" - "$W" <<'EOF'
import sys, zipfile, re
from pathlib import Path
from packaging.requirements import Requirement
h200 = set("""absl-py accelerate aiofiles anyio attrs certifi charset-normalizer click cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit filelock fsspec h11 hf-xet httpcore httpx huggingface-hub idna jinja2 markdown-it-py
markupsafe mdurl ml-dtypes numpy nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvtx packaging pillow prometheus-client protobuf psutil pygments pyyaml
regex requests rich safetensors sentencepiece shellingham six tokenizers torch tqdm transformers typer
typing-extensions urllib3 uvloop""".split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
skipped = {"textual"}  # gmlx's, for `gmlx top` only: not carried on purpose
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels}
bad = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                r = Requirement(line.split(":", 1)[1].strip())
                if r.marker is None or r.marker.evaluate(env):
                    n = norm(r.name)
                    if n not in have and n not in h200 and n not in skipped:
                        bad.append(f"{w.name}: {r}")
print("dependency check:", "ok" if not bad else "MISSING\n  " + "\n  ".join(bad))
EOF

# -- (c) llama.cpp's source ---------------------------------------------------------------
if [ ! -f "$G/llama.cpp.tar.gz" ]; then
  if ! compgen -G "$G/dl/llama_cpp_python-*.tar.gz" >/dev/null; then
    "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$G/dl" "$LLAMA_CPP_PYTHON"
  fi
  sdist=$(ls "$G"/dl/llama_cpp_python-*.tar.gz | head -1)
  tmp=$(mktemp -d)
  tar xzf "$sdist" -C "$tmp" --wildcards '*/vendor/llama.cpp/*'
  src=$(echo "$tmp"/*/vendor/llama.cpp)
  # Only what `cmake -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF` and the targets
  # llama-server, llama-bench and llama-quantize read; tools/ stays (its CMakeLists adds
  # every tool) but for the web UI's sources (the server builds without them).
  (cd "$src" && rm -rf .git models docs examples pocs tests media benches gguf-py conversion \
     .github .devops ci skills tools/ui/src tools/ui/tests tools/ui/static)
  echo "llama.cpp from $(basename "$sdist"): $(du -sh "$src" | cut -f1) unpacked"
  tar czf "$G/llama.cpp.tar.gz" -C "$(dirname "$src")" llama.cpp
  rm -rf "$tmp"
fi

# -- (d) the llama-bpe vocabulary --------------------------------------------------------
cp -f "$VOCAB_SRC" "$G/ggml-vocab-llama-bpe.gguf"

# -- (b) the parts ---------------------------------------------------------------------
cuda=$(ls "$W"/mlx_cuda_13-*.whl)
rm -rf "$G/pieces" "$G"/part[0-9]*
mkdir -p "$G/pieces"
split -b 29M -d -a 2 "$cuda" "$G/pieces/$(basename "$cuda").part"
"$PY" - "$G" "$PART_MIB" <<'EOF'
import hashlib, os, sys
from pathlib import Path
g, cap = Path(sys.argv[1]), int(sys.argv[2]) * 2**20
items = [g / "llama.cpp.tar.gz", g / "ggml-vocab-llama-bpe.gguf"]  # part1: the build starts first
items += sorted((g / "pieces").iterdir())
items += sorted(w for w in (g / "wheels").iterdir() if not w.name.startswith("mlx_cuda_13-"))
parts: list[list[Path]] = []
sizes: list[int] = []
for i, f in enumerate(items):
    size = f.stat().st_size
    # the first two items open part1; the rest go first-fit
    k = 0 if i < 2 else next((k for k, s in enumerate(sizes) if s + size <= cap), None)
    if k is None:
        parts.append([]); sizes.append(0); k = len(parts) - 1
    elif not parts:
        parts.append([]); sizes.append(0)
    parts[k].append(f); sizes[k] += size
sums = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in items)
whole = next((g / "wheels").glob("mlx_cuda_13-*.whl"))
sums += f"{hashlib.sha256(whole.read_bytes()).hexdigest()}  {whole.name}\n"
for n, (files, size) in enumerate(zip(parts, sizes), 1):
    d = g / f"part{n}"
    d.mkdir()
    for f in files:
        os.link(f, d / f.name)
    (d / "SHA256SUMS").write_text(sums)
    print(f"part{n}: {size / 2**20:5.1f} MiB, {len(files)} files: " + ", ".join(f.name for f in files))
EOF
du -sh "$G"/part*
