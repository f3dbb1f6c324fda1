#!/usr/bin/env bash
# Installs every Debian package fulgur needs to build, test and run its examples.
# Idempotent: packages already present are skipped, so a second run is fast.
# Usage: scripts/install-deps.sh        (as root, or with sudo available)
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev          # LibTorch 1.13 (CPU), with c10d and Gloo enabled
  libgloo-dev           # c10d's Gloo headers include Gloo's own
  libopenblas0-pthread  # otherwise Debian's LibTorch runs on the reference BLAS (~18x slower)
  libgtest-dev libgmock-dev googletest
  libcli11-dev          # command-line parsing for examples and tools
  zlib1g-dev            # reads the gzip IDX files of Fashion-MNIST
  dataset-fashion-mnist # the main job's data under /usr/share/datasets/fashion-mnist
  python3-torch         # torchrun (a launch path under test) and the Python peer benchmarks
  openmpi-bin           # mpirun (a launch path under test)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
