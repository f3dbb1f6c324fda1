#!/usr/bin/env bash
# Builds and tests this checkout inside a Debian 13 (trixie) root, on a Debian 12
# (or 13) machine: LibTorch 2.6 (CPU), or with --cuda Debian 13's CUDA build of
# LibTorch 2.6 (CUDA 12, NCCL) compiled, linked and its CPU suite run.
#
# Usage (as root): scripts/check-debian13.sh [--cuda] [--main-job] [--rebuild-root]
#                                             [--prepare-only] [--no-bench] [--no-examples]
#                                             [--werror] [--unoptimized] [--keep-build]
#                                             [--build-only]
#                                             [-- ctest arguments...]
#   --cuda          the CUDA root; tests run on the CPU (no GPU is needed or used)
#   --main-job      run the README's first command (the main job) inside, instead of
#                   the second (the test suite)
#   --rebuild-root  make the root anew even when the cached one is current
#   --prepare-only  make (or check) the root, then stop: no build, no tests
#   --no-bench      configure with -DFULGUR_BUILD_BENCH=OFF first (CI's CUDA check)
#   --no-examples   configure with -DFULGUR_BUILD_EXAMPLES=OFF first (CI's CUDA check;
#                   the tests of the examples are then not built either)
#   --werror        configure with -DFULGUR_WERROR=ON first: a compiler warning in
#                   fulgur's own code fails the build (CI)
#   --unoptimized   compile everything without optimisation (-O0; the tests share the
#                   library's precompiled header): a compile, link and behaviour check
#                   in less time (CI's CUDA step; the CPU step compiles at -O3)
#   --keep-build    work in $FULGUR_ROOT_CACHE/work/<variant>.kept and keep its build/
#                   for the next --keep-build run (the checkout is copied in anew
#                   each time; Ninja then rebuilds only what changed)
#   --build-only    install and build (with the options above), run no test: CI
#                   builds a root's tree in the background, then tests it with
#                   --keep-build in the foreground
#   after --        passed to ctest through scripts/run-tests.sh, e.g. -- -R 'DDP|Precision'
#
# What it does:
#   1. Makes a Debian 13 root with mmdebstrap from the Debian mirror this machine's
#      apt is configured with (read from apt, never written here), with the
#      components main contrib non-free, then runs scripts/install-deps.sh [--cuda]
#      inside it. Roots are cached under $FULGUR_ROOT_CACHE (default
#      /var/cache/fulgur/roots) and reused while the package list and this recipe
#      are unchanged; a half-made root is never reused.
#   2. Copies this checkout (tracked and untracked files that git does not ignore:
#      no build outputs) into a fresh work directory, and runs inside the root,
#      exactly as the README says: bash scripts/run-tests.sh (which installs, builds
#      and runs CTest), or with --main-job bash scripts/run-main-job.sh.
#   3. Prints CTest's summary. The exit status is the suite's.
# Everything inside runs in its own mount and PID namespaces (unshare): the mounts
# vanish and every process started inside is killed on any exit, even SIGKILL of
# this script.
#
# The --cuda root cannot download cuDNN (Debian's nvidia-cudnn package fetches it
# from NVIDIA when installed, and this machine reaches only the Debian mirror). It
# gets instead a LINK-ONLY STAND-IN: a package named nvidia-cudnn (version
# 9.99~fulgur.link.stub, held) holding a libcudnn.so.9 whose every function
# aborts with a message saying so. It lets libtorch_cuda.so load and link; it can
# never run a cuDNN kernel. Never install it on a machine with a GPU.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
cuda=0
main_job=0
rebuild=0
prepare_only=0
keep_build=0
build_only=0
build_args=()
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --main-job) main_job=1 ;;
    --rebuild-root) rebuild=1 ;;
    --prepare-only) prepare_only=1 ;;
    --no-bench) build_args+=(-DFULGUR_BUILD_BENCH=OFF) ;;
    --no-examples) build_args+=(-DFULGUR_BUILD_EXAMPLES=OFF) ;;
    --werror) build_args+=(-DFULGUR_WERROR=ON) ;;
    --unoptimized) build_args+=(-DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG -DFULGUR_UNOPTIMIZED_TESTS=OFF) ;;
    --keep-build) keep_build=1 ;;
    --build-only) build_only=1 ;;
    --) shift; ctest_args=("$@"); break ;;
    -h|--help) sed -n '2,53p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "check-debian13: unknown argument '$1' (known: --cuda, --main-job, --rebuild-root," \
            "--prepare-only, --no-bench, --no-examples, --werror, --unoptimized, --keep-build," \
            "--build-only," \
            "-- ctest args)" >&2
       exit 2 ;;
  esac
  shift
done

say() { echo "check-debian13: $*"; }
die() { echo "check-debian13: $*" >&2; exit 2; }

[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap, chroot, mounts); run it as root or with sudo"
command -v unshare >/dev/null || die "unshare (util-linux) is missing"
if ! command -v mmdebstrap >/dev/null; then
  say "installing mmdebstrap (Debian package) on this machine"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap; }
fi

# ---- The mirror: the URI of the Debian archive apt uses here (origin and label
# "Debian": not the security archive), as apt itself reports it.
debian_mirror() {
  apt-get indextargets --format '$(ORIGIN)|$(LABEL)|$(REPO_URI)' 2>/dev/null |
    awk -F'|' '$1 == "Debian" && $2 == "Debian" { print $3; exit }'
}
mirror="$(debian_mirror)"
if [ -z "$mirror" ]; then
  apt-get update -qq || true
  mirror="$(debian_mirror)"
fi
[ -n "$mirror" ] || die "found no Debian archive in this machine's apt sources (apt-get indextargets lists" \
  "none with Origin and Label 'Debian'); add one to /etc/apt/sources.list.d/ and run apt-get update"
mirror="${mirror%/}"

# ---- The root, cached by what goes into it.
variant=cpu
deps_args=()
if [ "$cuda" = 1 ]; then variant=cuda; deps_args=(--cuda); fi
cache="${FULGUR_ROOT_CACHE:-/var/cache/fulgur/roots}"
root="$cache/debian13-$variant"
mkdir -p "$cache"
exec 9>"$cache/.lock-$variant"
flock -w 3600 9 || die "another check-debian13.sh holds $cache/.lock-$variant for over an hour"

packages="$(FULGUR_DEBIAN_RELEASE=13 bash "$here/scripts/install-deps.sh" "${deps_args[@]}" --list)"
recipe_version=3  # bump when the way the root is made changes
key="$(printf '%s\n' "recipe $recipe_version" "variant $variant" "$packages" \
         "$(sed -n '/^cudnn_stub_package()/,/^}/p' "$0")" | sha256sum | cut -d' ' -f1)"

# Runs a command inside $1 (a root), in fresh mount and PID namespaces, with /proc,
# /dev, a tmpfs /tmp and the host's name resolution; extra "src:dst" binds in BINDS.
# It dies with this script (pdeathsig), and every process inside with it
# (--kill-child ends the namespace's first process, and with it the namespace);
# it runs in the background so that a signal to this script acts at once. Call it
# from this shell itself (not in a pipeline or a subshell), or pdeathsig watches
# the wrong parent.
in_root() {
  local r="$1"; shift
  local binds="${BINDS:-}" pid
  setpriv --pdeathsig KILL -- \
    unshare --mount --pid --fork --kill-child --propagation private -- bash -euc '
    r="$1"; binds="$2"; shift 2
    # The root a mount point of its own: inside, "/" is then a mount whose
    # propagation can change, as ip -n/ip netns exec and unshare --mount change
    # it (on a plain directory that fails with EINVAL).
    mount --bind "$r" "$r"
    mount -t proc proc "$r/proc"
    mount --rbind /dev "$r/dev"
    mount -t tmpfs -o size=50% tmpfs "$r/dev/shm"
    mount -t tmpfs tmpfs "$r/tmp"
    mount -t sysfs sysfs "$r/sys" 2>/dev/null || true
    for f in /etc/resolv.conf /etc/hosts; do
      [ -e "$f" ] && { touch "$r$f"; mount --bind -o ro "$f" "$r$f"; }
    done
    for b in $binds; do
      mkdir -p "$r${b#*:}"
      mount --bind "${b%%:*}" "$r${b#*:}"
    done
    exec chroot "$r" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      DEBIAN_FRONTEND=noninteractive "$@"
  ' in_root "$r" "$binds" "$@" &
  pid=$!
  wait "$pid"
}

# The link-only cuDNN stand-in (see the header). Made inside the root: the stub
# exports every cudnn* symbol that the CUDA LibTorch's libraries import.
cudnn_stub_package() {
  local r="$1"
  in_root "$r" bash -euc '
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends build-essential binutils >/dev/null
    w=$(mktemp -d); cd "$w"
    # The LibTorch runtime package, unpacked to read what it imports from cuDNN.
    pkg=$(apt-cache depends libtorch-cuda-dev | awk "/Depends: libtorch-cuda/ {print \$2; exit}")
    apt-get download -qq "$pkg"; dpkg-deb -x ./*.deb x
    # "cudnnCreate@libcudnn.so.9": the name, and the version node it is bound to.
    find x -name "*.so*" -type f -exec nm -D --undefined-only {} + 2>/dev/null |
      awk "{print \$2}" | grep "^cudnn" | sort -u > imports
    [ -s imports ] || { echo "no cudnn symbols imported by $pkg" >&2; exit 1; }
    sed "s/@.*//" imports | sort -u > symbols
    # A version script giving each symbol the version node LibTorch asks for.
    grep "@" imports | sed "s/^[^@]*@*//" | sort -u | while read -r node; do
      echo "$node { global:"
      grep "@@*$node\$" imports | sed "s/@.*//; s/.*/  &;/"
      echo "};"
    done > versions
    [ -s versions ] && version_flag="-Wl,--version-script=versions" || version_flag=""
    {
      echo "/* fulgur: LINK-ONLY cuDNN stand-in for a build check without a GPU. */"
      echo "#include <stdio.h>"
      echo "#include <stdlib.h>"
      echo "static void stub(const char* f) { fprintf(stderr, \"%s: fulgur link-only cuDNN stub called; install the real cuDNN (nvidia-cudnn)\\n\", f); abort(); }"
      while read -r s; do echo "int $s(void) { stub(\"$s\"); return 1; }"; done < symbols
    } > stub.c
    mkdir -p p/DEBIAN p/usr/lib/x86_64-linux-gnu
    gcc -shared -fPIC -O1 -Wl,-soname,libcudnn.so.9 $version_flag \
      -o p/usr/lib/x86_64-linux-gnu/libcudnn.so.9 stub.c
    ln -s libcudnn.so.9 p/usr/lib/x86_64-linux-gnu/libcudnn.so
    # Named as the package the CUDA LibTorch depends on (nvidia-cudnn, whose
    # real version downloads cuDNN from NVIDIA), at a version above the archive one,
    # and held, so that apt never replaces it.
    cat > p/DEBIAN/control <<EOF
Package: nvidia-cudnn
Version: 9.99~fulgur.link.stub
Architecture: amd64
Maintainer: fulgur <fulgur@localhost>
Provides: libcudnn.so.9
Description: LINK-ONLY cuDNN stand-in for building fulgur without a GPU
 Every function aborts. Made by fulgur scripts/check-debian13.sh --cuda.
EOF
    dpkg-deb --build p nvidia-cudnn-link-stub.deb >/dev/null
    dpkg -i nvidia-cudnn-link-stub.deb >/dev/null
    apt-mark hold nvidia-cudnn >/dev/null
    echo "cuDNN link-only stand-in installed as nvidia-cudnn 9.99~fulgur.link.stub: $(wc -l < symbols) functions, each aborting"
    cd /; rm -rf "$w"
  '
}

make_root() {
  local new="$root.new"
  rm -rf "$new"
  say "making the Debian 13 root ($variant) in $new from $mirror"
  local t0=$SECONDS
  # A root for builds and tests, made anew when its packages change: dpkg
  # unpacks without an fsync per file (force-unsafe-io; a root cut short is
  # never used, see .new below) and leaves out manuals, translations and
  # documentation but the copyrights (kept in /etc/dpkg/dpkg.cfg.d/99mmdebstrap,
  # so for install-deps.sh's packages too). Under CI's foreground build, at
  # the lowest priorities, a root took 25 minutes with an fsync per file.
  mmdebstrap --variant=apt --components="main contrib non-free" \
    --include=ca-certificates,git --aptopt='Acquire::Retries "3"' \
    --dpkgopt=force-unsafe-io \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    trixie "$new" "$mirror" >"$cache/mmdebstrap-$variant.log" 2>&1 ||
    die "mmdebstrap failed (log: $cache/mmdebstrap-$variant.log)"
  if [ "$cuda" = 1 ]; then
    cudnn_stub_package "$new"
  fi
  # The packages, through the project's own script (copied in alone).
  mkdir -p "$new/opt/fulgur-deps"
  cp "$here/scripts/install-deps.sh" "$new/opt/fulgur-deps/"
  in_root "$new" bash /opt/fulgur-deps/install-deps.sh "${deps_args[@]}"
  rm -rf "$new/opt/fulgur-deps"
  in_root "$new" apt-get clean
  echo "$key" >"$new/.fulgur-root-key"
  rm -rf "$root"
  mv "$new" "$root"
  say "root ready in $((SECONDS - t0)) s ($(du -sh "$root" | cut -f1))"
}

if [ "$rebuild" = 1 ] || [ "$(cat "$root/.fulgur-root-key" 2>/dev/null)" != "$key" ]; then
  make_root
else
  say "reusing $root (package list unchanged)"
fi
[ "$prepare_only" = 0 ] || exit 0

# ---- A clean copy of this checkout, in a work directory removed on every exit
# (with --keep-build: one kept per variant, whose build/ alone survives).
mkdir -p "$cache/work" "$cache/ccache-$variant"
for d in "$cache"/work/*.[0-9]*; do  # work directories of runs that were killed
  [ -d "$d" ] && ! kill -0 "${d##*.}" 2>/dev/null && rm -rf "$d"
done
if [ "$keep_build" = 1 ]; then
  work="$cache/work/$variant.kept"
  mkdir -p "$work/fulgur"
  rm -f "$work/log"
else
  work="$cache/work/$variant.$$"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/fulgur"
fi
trap 'exit 130' INT
trap 'exit 143' TERM
checkout_archive() {
  (cd "$here" && git ls-files -z --cached --others --exclude-standard |
     xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh |
     tar --null -T - -cf -)
}
if [ "$keep_build" = 1 ]; then
  # Into the kept tree: a file whose content is unchanged since the last run
  # stays as it was, with its date; any other is dated now (tar -m). Ninja
  # then rebuilds exactly what changed since that run, whatever the dates in
  # this checkout (a file edited here before the kept build was made from
  # another checkout would otherwise look older than its object file).
  incoming="$work/incoming"
  rm -rf "$incoming"
  mkdir -p "$incoming"
  checkout_archive | tar -xmf - -C "$incoming"
  (cd "$work/fulgur" && find . -path ./build -prune -o ! -type d -print0) |
    while IFS= read -r -d '' f; do
      [ -e "$incoming/$f" ] || [ -L "$incoming/$f" ] || rm -f "$work/fulgur/$f"
    done
  (cd "$incoming" && find . ! -type d -print0) |
    while IFS= read -r -d '' f; do
      if [ -L "$incoming/$f" ] || ! cmp -s "$incoming/$f" "$work/fulgur/$f"; then
        mkdir -p "$(dirname "$work/fulgur/$f")"
        rm -rf "$work/fulgur/$f"
        mv "$incoming/$f" "$work/fulgur/$f"
      fi
    done
  rm -rf "$incoming"
else
  checkout_archive | tar -xf - -C "$work/fulgur"
fi
say "copied $(cd "$work/fulgur" && find . -path ./build -prune -o -type f -print | wc -l) files of $here"

commands='bash scripts/run-tests.sh "$@"'
if [ "$build_only" = 1 ]; then
  commands="bash scripts/install-deps.sh && bash scripts/build.sh ${build_args[*]}"
elif [ "${#build_args[@]}" -gt 0 ]; then
  # The cache keeps the options for run-tests.sh's own configure.
  commands="bash scripts/install-deps.sh && bash scripts/build.sh ${build_args[*]} && $commands"
fi
if [ "$main_job" = 1 ]; then
  commands='bash scripts/run-main-job.sh'
fi
commands="cd /work/fulgur && $commands"
# Not in a pipeline: in_root must be this shell's own child (see in_root).
set +e
BINDS="$work:/work $cache/ccache-$variant:/root/.cache/ccache" \
  in_root "$root" bash -c "$commands" run "${ctest_args[@]}" > >(tee "$work/log") 2>&1
status=$?
set -e
wait  # for tee
last="$cache/last-$variant.log"
[ "$build_only" = 0 ] || last="$cache/last-$variant-build.log"
cp "$work/log" "$last"

echo
say "Debian 13, LibTorch $(sed -n 's/^Version: //p' <(chroot "$root" dpkg -s libtorch-dev libtorch-cuda-dev 2>/dev/null) | head -1), $variant:"
grep -E '^[0-9]+% tests passed|^The following tests|^[[:space:]]+[0-9]+ - |^Total Test time' "$last" || true
say "full log: $last; exit status $status"
exit "$status"
