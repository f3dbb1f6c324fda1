#!/usr/bin/env bash
# Installs every Debian package fulgur needs to build, test and run its examples,
# on Debian 12 (bookworm: LibTorch 1.13) or Debian 13 (trixie: LibTorch 2.6).
# Idempotent: packages already present are skipped, so a second run is fast.
#
# Usage: scripts/install-deps.sh [--cuda | --cpu] [--list]   (as root, or with sudo available)
#   --cuda   Debian 13's CUDA build of LibTorch (contrib; with NCCL) instead of the
#            CPU one. Needs "contrib non-free" in the apt sources. The cuDNN it
#            depends on is downloaded from NVIDIA by Debian's nvidia-cudnn package.
#            Without --cuda or --cpu, the CUDA build is kept where it is installed.
#   --cpu    the CPU build of LibTorch (replacing the CUDA one where it is installed)
#   --list   print the packages that would be installed, one per line, and exit
# FULGUR_DEBIAN_RELEASE=12|13 overrides the release read from /etc/os-release.
set -euo pipefail

cuda=""
list=0
for arg in "$@"; do
  case "$arg" in
    --cuda) cuda=1 ;;
    --cpu) cuda=0 ;;
    --list) list=1 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-deps: unknown argument '$arg' (known: --cuda, --cpu, --list, --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$cuda" ]; then
  cuda=0
  if dpkg-query -W -f='${Status}' libtorch-cuda-dev 2>/dev/null | grep -q 'install ok installed'; then
    cuda=1
    [ "$list" = 1 ] || echo "install-deps: keeping the CUDA build of LibTorch installed here (--cpu replaces it)"
  fi
fi

release="${FULGUR_DEBIAN_RELEASE:-}"
if [ -z "$release" ]; then
  # shellcheck disable=SC1091
  . /etc/os-release 2>/dev/null || true
  case "${ID:-}:${VERSION_ID:-}:${VERSION_CODENAME:-}" in
    debian:12:*|debian:*:bookworm) release=12 ;;
    debian:13:*|debian:*:trixie) release=13 ;;
    *)
      echo "install-deps: this is '${PRETTY_NAME:-unknown (no /etc/os-release)}'; fulgur's" \
           "dependencies are listed for Debian 12 (bookworm) and Debian 13 (trixie)." \
           "On a derivative of one of them, set FULGUR_DEBIAN_RELEASE=12 or 13." >&2
      exit 2 ;;
  esac
fi
case "$release" in
  12|13) ;;
  *) echo "install-deps: FULGUR_DEBIAN_RELEASE='$release'; use 12 or 13" >&2; exit 2 ;;
esac

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libopenblas0-pthread  # otherwise Debian's LibTorch runs on the reference BLAS (~18x slower)
  libgtest-dev libgmock-dev googletest
  libcli11-dev          # command-line parsing for examples and tools
  zlib1g-dev            # reads the gzip IDX files of Fashion-MNIST
  libisal-dev           # CRC32C of every checkpoint (Intel ISA-L)
  gnuplot-nox           # the curves of a run as a PNG (CSVLogger, fulgur plot)
  libyaml-cpp-dev       # config files of fulgur::cli
  libprotobuf-dev libprotoc-dev  # the tests read TensorBoard's event files with Google's protobuf
  dataset-fashion-mnist # the main job's data under /usr/share/datasets/fashion-mnist
  openmpi-bin           # mpirun (a launch path under test)
  slurmctld slurmd      # a real SLURM cluster on localhost (scripts/slurm-cluster.sh),
  slurm-client          #   a launch path under test: srun, sbatch, scontrol, sinfo
  munge                 # SLURM's authentication; the cluster script runs its own munged and key
  iproute2 iputils-ping # nodes as network namespaces (scripts/netns-cluster.sh): ip, tc, ping
)
if [ "$cuda" = 1 ]; then
  if [ "$release" = 12 ]; then
    echo "install-deps: --cuda: Debian 12 has no CUDA build of LibTorch. Use Debian 13" \
         "(libtorch-cuda-dev in contrib), or build against pytorch.org's CUDA LibTorch zip" \
         "with scripts/build.sh -DCMAKE_PREFIX_PATH=/path/to/libtorch." >&2
    exit 2
  fi
  packages+=(
    libtorch-cuda-dev     # LibTorch 2.6 with CUDA 12 and ProcessGroupNCCL (contrib)
    libgloo-cuda-dev      # Gloo's headers, CUDA build
    libnccl-dev           # NCCL (non-free)
    nvidia-cuda-toolkit   # nvcc and the CUDA headers: Torch's CMake config looks for them (non-free)
    python3-torch-cuda    # torchrun
    libopenmpi-dev        # Debian 13's Torch is built with ProcessGroupMPI: <mpi.h>
  )
else
  packages+=(
    libtorch-dev          # LibTorch (CPU): 1.13 on Debian 12, 2.6 on Debian 13; c10d with Gloo
    libgloo-dev           # c10d's Gloo headers include Gloo's own
    python3-torch         # torchrun (a launch path under test) and the Python peer benchmarks
  )
  if [ "$release" = 13 ]; then
    packages+=(libopenmpi-dev)  # Debian 13's Torch is built with ProcessGroupMPI: <mpi.h>
  fi
fi

if [ "$list" = 1 ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages for Debian $release already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: Debian $release: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
if [ "$cuda" = 1 ] && ! apt-cache show libtorch-cuda-dev >/dev/null 2>&1; then
  echo "install-deps: --cuda: apt knows no package libtorch-cuda-dev. It is in Debian 13's" \
       "'contrib' section and NCCL and the CUDA toolkit are in 'non-free': add" \
       "'contrib non-free' to the Components of the Debian entry in /etc/apt/sources.list.d/" \
       "(or to the 'deb' line of /etc/apt/sources.list), then run this again." >&2
  exit 2
fi
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
