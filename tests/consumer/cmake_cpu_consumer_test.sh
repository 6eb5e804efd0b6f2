#!/usr/bin/env bash
# The CMake route on a CPU machine (docs/consuming.md): configures and builds d9d's library alone
# (no tests, examples or benchmarks) against the LibTorch of tools/setup in a clean build
# directory, installs it, then builds tests/cmake_consumer with find_package(d9d) from a clean
# directory and runs it. Also checks that the default configuration (D9D_WITH_CUDA=AUTO, which
# enables the kernels when nvcc and a CUDA LibTorch are both present) generates.
#
# The library's ~85 files take about 6 minutes on 2 cores the first time (Release; measured alone:
# 354 s, and 285 s at -O0, but Release is what users build and GCC's -O3 warnings are -Werror);
# ccache (tools/setup installs it) keeps the objects in $D9D_HOME/ccache, so later runs recompile
# only what changed. For ccache to hit, the sources are copied to a fixed path
# ($D9D_HOME/cmake-consumer/src) and the build directory is always the same path, emptied first.
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
root=$(cd "$here/../.." && pwd)
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
# shellcheck disable=SC1091
[ -f "$home/.cache/d9d/env" ] && source "$home/.cache/d9d/env"
[ -n "${D9D_TORCH_CMAKE_PREFIX:-}" ] || fail "no LibTorch: run tools/setup"
D9D_HOME=${D9D_HOME:-$home/.cache/d9d}
base="$D9D_HOME/cmake-consumer"
mkdir -p "$base"
exec 9>"$base/lock"
flock 9 || fail "cannot lock $base/lock"
src="$base/src"
build="$base/d9d-build"
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/cmake-consumer.XXXXXX")
trap 'rm -rf "$work" "$build"' EXIT

# The library's sources, byte for byte, at the fixed path (rsync keeps unchanged files' times).
mkdir -p "$src"
rsync -a --delete --checksum --exclude '/tests/' --exclude '/bazel-*' --exclude '/.git/' \
  --exclude '/.deps/' --exclude '/build*/' "$root/" "$src/" || fail "copying the sources"

launcher=()
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_DIR="$D9D_HOME/ccache"
  export CCACHE_MAXSIZE=4G
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
else
  echo "note: no ccache (tools/setup installs it): the library compiles from scratch"
fi

# The default configuration must generate (nvcc and this LibTorch may both be CUDA-capable).
cmake -S "$src" -B "$work/auto" -G Ninja -DCMAKE_BUILD_TYPE=Release -DD9D_BUILD_TESTS=OFF \
  -DD9D_BUILD_EXAMPLES=OFF -DD9D_BUILD_BENCH=OFF -DCMAKE_PREFIX_PATH="$D9D_TORCH_CMAKE_PREFIX" \
  >"$work/auto.log" 2>&1 || { cat "$work/auto.log"; fail "configuring d9d with D9D_WITH_CUDA=AUTO"; }
grep "d9d: CUDA kernels" "$work/auto.log"

# The CPU build (D9D_WITH_CUDA=OFF: no nvcc compile of the kernels on a machine without a GPU).
rm -rf "$build"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DD9D_WITH_CUDA=OFF \
  -DD9D_BUILD_TESTS=OFF -DD9D_BUILD_EXAMPLES=OFF -DD9D_BUILD_BENCH=OFF "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$D9D_TORCH_CMAKE_PREFIX" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; fail "configuring d9d"; }
start=$(date +%s)
cmake --build "$build" -j "$(nproc)" >"$work/build.log" 2>&1 ||
  { tail -n 50 "$work/build.log"; fail "building d9d"; }
echo "library built in $(($(date +%s) - start)) s"
[ ${#launcher[@]} -eq 0 ] || ccache --show-stats 2>/dev/null | grep -iE "hits|misses" | head -4
cmake --install "$build" --prefix "$work/prefix" >/dev/null || fail "installing d9d"

# The user's project, from a clean directory, against the installed library only.
cp -r "$root/tests/cmake_consumer" "$work/project"
cmake -S "$work/project" -B "$work/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix;$D9D_TORCH_CMAKE_PREFIX" >"$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "configuring the consumer"; }
cmake --build "$work/consumer" >>"$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "building the consumer"; }
"$work/consumer/consumer" || fail "the consumer failed"
echo "ok"
