#!/usr/bin/env bash
# Configures and builds fulgur (library, tests, examples, benchmarks) in build/
# with Ninja, Release by default. Extra arguments go to the configure step:
#   scripts/build.sh -DFULGUR_BUILD_BENCH=OFF
# A second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build
