#!/usr/bin/env bash
# Prepares, on a Debian machine with apt, what a GPU machine without network
# and without Debian's packages needs to build fulgur against the LibTorch of
# its pip PyTorch: Debian's dev packages (yaml-cpp, GoogleTest, ISA-L,
# CLI11, zlib) and the main job's dataset, unpacked under one prefix that
# travels with the checkout, and Gloo's headers from Debian 13's libgloo-dev
# (recent LibTorch's c10d headers include gloo/common/store.h, which Debian
# 12's Gloo lacks), fetched through a private apt state from the Debian
# mirror this machine's apt uses.
#
# Usage: bash scripts/gpu-carry.sh [DIR]      (default: .gpu-carry, git-ignored)
# Then, on the GPU machine:
#   bash scripts/gpu-check.sh --pip-torch --deps .gpu-carry
# (--deps puts DIR/usr on CMake's, pkg-config's, the compiler's and the
# loader's search paths.) The packages are the Debian release's of this
# machine; their libraries need a glibc at least as new, which the GPU
# machines' Ubuntu 24.04 has.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-carry}

packages=(
  libyaml-cpp-dev "libyaml-cpp0.[0-9]*"
  libgtest-dev libgmock-dev
  libcli11-dev
  zlib1g-dev zlib1g
  libisal-dev "libisal2"
  dataset-fashion-mnist
)
mkdir -p "$dir/debs" "$dir/root"
# Resolve the runtime library names (their version is part of the name).
names=()
for p in "${packages[@]}"; do
  if [[ "$p" == *"*"* ]]; then
    found=$(apt-cache pkgnames | grep -x "${p//\*/.*}" | head -1 || true)
    [ -n "$found" ] || { echo "gpu-carry: apt knows no package matching $p" >&2; exit 2; }
    names+=("$found")
  else
    names+=("$p")
  fi
done
(cd "$dir/debs" && apt-get download -q "${names[@]}")
# Gloo from Debian 13: its own sources list, lists and cache, so this
# machine's apt is left as it is.
mirror=$(apt-get indextargets --format '$(ORIGIN)|$(LABEL)|$(REPO_URI)' 2>/dev/null |
  awk -F'|' '$1 == "Debian" && $2 == "Debian" { print $3; exit }')
[ -n "$mirror" ] || { echo "gpu-carry: found no Debian archive in apt's sources" \
  "(apt-get indextargets); add one and run apt-get update" >&2; exit 2; }
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
echo "deb ${mirror%/} trixie main" >"$state/sources.list"
opts=(-o Dir::Etc::SourceList="$state/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o Dir::State::Lists="$state/lists" -o Dir::Cache="$state/cache")
apt-get "${opts[@]}" update -qq
(cd "$dir/debs" && apt-get "${opts[@]}" download -q libgloo-dev)
for deb in "$dir"/debs/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
# pkg-config files name /usr as their prefix: point them at the unpacked tree
# wherever it lands (pcfiledir is pkg-config's own variable).
find "$dir/root" -name '*.pc' -print0 | while IFS= read -r -d '' pc; do
  rel=$(realpath --relative-to="$(dirname "$pc")" "$dir/root/usr")
  sed -i "s|^prefix=/usr\$|prefix=\${pcfiledir}/$rel|" "$pc"
done
# Absolute links into /usr (libfoo.so -> /usr/lib/...) would point outside.
find "$dir/root" -type l -lname '/*' -print0 | while IFS= read -r -d '' link; do
  target=$(readlink "$link")
  ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$dir/root$target")" "$link"
done
rm -rf "$dir/debs"
echo "gpu-carry: $(du -sh "$dir" | cut -f1) in $dir (${names[*]}, libgloo-dev from Debian 13)"
