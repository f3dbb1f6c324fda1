#!/usr/bin/env bash
# The main job on a fresh Debian 12 or 13 machine: install the dependencies, build,
# and train the Fashion-MNIST example (test accuracy >= 0.90 with the defaults).
# Arguments go to the example, e.g.:
#   scripts/run-main-job.sh --max_epochs 5 --min-test-acc 0.9
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
bash scripts/build.sh
exec build/examples/fashion_mnist/fashion_mnist "$@"
