#!/usr/bin/env bash
# What only a machine with NVIDIA GPUs can check: builds fulgur against a CUDA
# LibTorch and runs every CUDA test, then the main job on the GPUs.
#
# Usage: scripts/gpu-check.sh [cmake configure arguments...]
#   On Debian 13 with Debian's CUDA LibTorch (bash scripts/install-deps.sh --cuda):
#     bash scripts/gpu-check.sh
#   With pytorch.org's CUDA LibTorch zip unpacked in /opt/libtorch:
#     bash scripts/gpu-check.sh -DCMAKE_PREFIX_PATH=/opt/libtorch
#
# It builds in build-gpu/ (no benchmarks), then runs:
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

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L fails or is missing); this script is for" \
       "a machine with one. Without a GPU, scripts/check-debian13.sh --cuda compiles and links" \
       "the CUDA build." >&2
  exit 2
fi
gpus=$(nvidia-smi -L | grep -c '^GPU ')
echo "gpu-check: $gpus GPU(s):"
nvidia-smi -L

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFULGUR_BUILD_BENCH=OFF "$@"
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
ctest --test-dir build-gpu --output-on-failure --timeout 600 -R '_CUDA' || fail $?
ctest --test-dir build-gpu --output-on-failure --timeout 600 \
  -R 'ProcessGroup|Precision|DDP|LaunchPaths|Accelerator|SyncBatchNorm|DataLoaderWorkers|ArchiveSnapshot|AsyncCheckpointIO' || fail $?

devices=$(( gpus >= 2 ? 2 : 1 ))
strategy=$([ "$devices" -ge 2 ] && echo ddp || echo single_device)
echo "gpu-check: main job on $devices GPU(s), strategy $strategy"
build-gpu/examples/fashion_mnist/fashion_mnist --accelerator cuda --devices "$devices" \
  --strategy "$strategy" || fail $?
exit "$status"
