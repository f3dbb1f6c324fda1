#!/usr/bin/env bash
# What only a machine with NVIDIA GPUs can check: builds fulgur against a CUDA
# LibTorch and runs every CUDA test, then the main job on the GPUs.
#
# Usage: scripts/gpu-check.sh [--deps DIR] [--pip-torch] [--bench] [--quick]
#                            [cmake configure arguments...]
# (--deps and --pip-torch first, in this order)
#   On Debian 13 with Debian's CUDA LibTorch (bash scripts/install-deps.sh --cuda):
#     bash scripts/gpu-check.sh
#   With pytorch.org's CUDA LibTorch zip unpacked in /opt/libtorch:
#     bash scripts/gpu-check.sh -DCMAKE_PREFIX_PATH=/opt/libtorch
#   With the LibTorch inside a CUDA PyTorch pip install (python3 imports torch):
#     bash scripts/gpu-check.sh --pip-torch
#     It finds the wheel's CMake package, NCCL in the nvidia-nccl wheel, and
#     defines USE_C10D_GLOO/USE_C10D_NCCL, which the wheel's CMake package does
#     not pass on. The wheel has no Gloo headers: Debian's libgloo-dev (or
#     -I to another copy in CXXFLAGS) provides them. Checked with torch 2.11
#     (CUDA 13) on an H200.
#
#   On a machine without Debian's packages (no network, no apt), with the
#   dev packages that scripts/gpu-carry.sh unpacked into DIR on a Debian
#   machine and carried along:
#     bash scripts/gpu-check.sh --deps .gpu-carry --pip-torch --bench
#   --deps puts DIR/usr on CMake's, pkg-config's, the compiler's and the
#   loader's search paths, and links the main job's dataset into place.
#   --bench also builds the GPU benchmark and runs it after the checks
#   (bench/gpu.cpp, then bench/gpu.py where python3 has torch; they write
#   bench/gpu-results.md and bench/gpu-results-python.md).
#   --quick runs only step 1 and 3 below (for a short lease of a GPU).
#
# It builds in build-gpu/ (no benchmarks unless --bench), then runs:
#   1. the CUDA tests (named *_CUDA; on a machine without enough GPUs each skips
#      and says how many it needs): devices and batches on CUDA, bf16-mixed and
#      16-mixed with the GradScaler, deterministic seeded runs, NCCL two-rank DDP
#      against one process and against Gloo on the CPU, SyncBatchNorm over NCCL,
#      ddp_fork refused on CUDA;
#   2. the process-group, precision, DDP and launch-path suites on this build;
#   3. the main job: --accelerator cuda --devices N --strategy ddp (N = the GPUs
#      found, at most 2; single_device when there is one).
# Exit status: 0 when everything passed, else the first failure's.
set -euo pipefail
cd "$(dirname "$0")/.."

# --bench and --quick anywhere; the rest in the order of the usage line.
bench=0
quick=0
args=()
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1 ;;
    --quick) quick=1 ;;
    *) args+=("$arg") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
if [ "${1:-}" = "--deps" ]; then
  deps=$(cd "${2:?--deps needs a directory (made by scripts/gpu-carry.sh)}" && pwd)/root/usr
  shift 2
  [ -d "$deps/include" ] || { echo "gpu-check: --deps: $deps/include is missing; make the" \
    "directory with bash scripts/gpu-carry.sh DIR on a Debian machine" >&2; exit 2; }
  arch_lib="$deps/lib/x86_64-linux-gnu"
  export CMAKE_PREFIX_PATH="$deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_PATH="$arch_lib/pkgconfig:$deps/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export CXXFLAGS="${CXXFLAGS:-} -I$deps/include"
  export LDFLAGS="${LDFLAGS:-} -L$arch_lib -Wl,-rpath,$arch_lib"
  export LD_LIBRARY_PATH="$arch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ -d "$deps/share/datasets/fashion-mnist" ] && [ ! -e /usr/share/datasets/fashion-mnist ]; then
    mkdir -p /usr/share/datasets 2>/dev/null &&
      ln -s "$deps/share/datasets/fashion-mnist" /usr/share/datasets/fashion-mnist 2>/dev/null ||
      echo "gpu-check: --deps: could not link the dataset into /usr/share/datasets" >&2
  fi
fi
if [ "${1:-}" = "--pip-torch" ]; then
  shift
  prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || {
    echo "gpu-check: --pip-torch: python3 cannot import torch; install a CUDA PyTorch or pass" \
         "-DCMAKE_PREFIX_PATH=/path/to/libtorch instead." >&2
    exit 2
  }
  site=$(cd "$prefix/../../.." && pwd)
  nccl_h=$(find "$site/nvidia" -name nccl.h -path '*nccl*' 2>/dev/null | head -1)
  nccl_so=$(find "$site/nvidia" -name 'libnccl.so*' 2>/dev/null | head -1)
  flags="${CXXFLAGS:-} -DUSE_C10D_GLOO"
  libs=""
  if [ -n "$nccl_h" ] && [ -n "$nccl_so" ]; then
    flags="$flags -DUSE_C10D_NCCL -I$(dirname "$nccl_h")"
    libs="-L$(dirname "$nccl_so") -l:$(basename "$nccl_so") -Wl,-rpath,$(dirname "$nccl_so")"
  else
    echo "gpu-check: --pip-torch: no NCCL found under $site/nvidia; building without NCCL" >&2
  fi
  if [ ! -e /usr/include/gloo/algorithm.h ] && [ ! -e "${deps:-/nonexistent}/include/gloo/algorithm.h" ] &&
     [[ "$flags" != *gloo* ]]; then
    echo "gpu-check: --pip-torch: the wheel has no Gloo headers and /usr/include/gloo is" \
         "missing: install libgloo-dev, or put -I/path/to/gloo-headers in CXXFLAGS." >&2
    exit 2
  fi
  set -- -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_CXX_STANDARD_LIBRARIES="$libs" "$@"
  echo "gpu-check: LibTorch $(python3 -c 'import torch; print(torch.__version__)') from $prefix"
fi

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L fails or is missing); this script is for" \
       "a machine with one. Without a GPU, scripts/check-debian13.sh --cuda compiles and links" \
       "the CUDA build." >&2
  exit 2
fi
gpus=$(nvidia-smi -L | grep -c '^GPU ')
echo "gpu-check: $gpus GPU(s):"
nvidia-smi -L

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFULGUR_BUILD_BENCH=$([ "$bench" = 1 ] && echo ON || echo OFF) "$@"
cmake --build build-gpu

# The build must see the GPUs, or every test below would only skip.
if ! build-gpu/tools/fulgur resolve --accelerator cuda --devices 1 >/dev/null; then
  echo "gpu-check: fulgur built against this LibTorch sees no CUDA device (fulgur resolve" \
       "--accelerator cuda above says why). Pass a CUDA LibTorch with -DCMAKE_PREFIX_PATH=..." \
       "or install Debian 13's with scripts/install-deps.sh --cuda." >&2
  exit 2
fi

status=0
fail() { [ "$status" != 0 ] || status=$1; }
# A LibTorch error (a synchronising call under the sync-debug mode, say)
# names where it was raised: one run on a lent GPU has to be enough.
export TORCH_SHOW_CPP_STACKTRACES=1
ctest --test-dir build-gpu --output-on-failure --timeout 600 -R '_CUDA' || fail $?
if [ "$quick" = 0 ]; then
  ctest --test-dir build-gpu --output-on-failure --timeout 600 \
    -R 'ProcessGroup|Precision|DDP|LaunchPaths|Accelerator|SyncBatchNorm|DataLoaderWorkers|StateSnapshot|AsyncCheckpointIO|GradScaler|GradientReducer|AsyncHostCopy' || fail $?
fi

devices=$(( gpus >= 2 ? 2 : 1 ))
strategy=$([ "$devices" -ge 2 ] && echo ddp || echo single_device)
echo "gpu-check: main job on $devices GPU(s), strategy $strategy"
now() { date +%s.%N; }
start=$(now)
build-gpu/examples/fashion_mnist/fashion_mnist --accelerator cuda --devices "$devices" \
  --strategy "$strategy" || fail $?
echo "gpu-check: main job: $(awk "BEGIN { printf \"%.1f\", $(now) - $start }") s"
if [ "$devices" = 1 ]; then
  echo "gpu-check: the main job with --cuda_graph true"
  start=$(now)
  build-gpu/examples/fashion_mnist/fashion_mnist --accelerator cuda --devices 1 \
    --cuda_graph true --default_root_dir runs/cuda_graph || fail $?
  echo "gpu-check: main job, cuda_graph: $(awk "BEGIN { printf \"%.1f\", $(now) - $start }") s"
fi
if [ "$bench" = 1 ]; then
  echo "gpu-check: the GPU benchmark"
  build-gpu/bench/fulgur_bench gpu --markdown bench/gpu-results.md || fail $?
  build-gpu/bench/fulgur_bench optimizers --device cuda --steps 500 --reps 5 || fail $?
  if python3 -c 'import torch' 2>/dev/null; then
    python3 bench/gpu.py --markdown bench/gpu-results-python.md || fail $?
  fi
fi
exit "$status"
