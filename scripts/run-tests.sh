#!/usr/bin/env bash
# Installs the dependencies, builds, and runs the whole test suite with CTest.
# Exits with CTest's status. Extra arguments go to ctest, e.g.:
#   scripts/run-tests.sh -R checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
bash scripts/build.sh
# Three quarters of the suite's CPU time is LibTorch starting (~1000
# processes: each test program, launcher and rank). On Debian 12 (LibTorch
# 1.13, 289 libraries) a start takes 0.95 s of CPU, 0.62 s with these two:
# OpenBLAS starts no thread pool that spins while LibTorch initialises (the
# suite runs two tests at once on two cores; launchers give their ranks one
# thread each anyway), and malloc backs the heap with huge pages (fewer page
# faults in LibTorch's static initialisers). fulgur's own malloc tuning
# combines with glibc.malloc.hugetlb (utilities/host_allocator.h). A
# caller's own values are kept.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
# --no-tests=error: a -R that matches no test fails instead of passing.
ctest --test-dir build --output-on-failure --timeout 600 -j2 --no-tests=error "$@"
