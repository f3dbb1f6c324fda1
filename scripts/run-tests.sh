#!/usr/bin/env bash
# Installs the dependencies, builds, and runs the whole test suite with CTest.
# Exits with CTest's status. Extra arguments go to ctest, e.g.:
#   scripts/run-tests.sh -R checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
bash scripts/build.sh
# --no-tests=error: a -R that matches no test fails instead of passing.
ctest --test-dir build --output-on-failure --timeout 600 -j2 --no-tests=error "$@"
