#!/usr/bin/env bash
# The CMake route on a CPU machine (docs/consuming.md): configures and builds d9d's library alone
# (no tests, examples or benchmarks) against the LibTorch of tools/setup in a clean temporary
# directory, installs it, then builds tests/cmake_consumer with find_package(d9d) and runs it.
# Compiles the whole library (about 45 files): 20-30 minutes on 2 cores, hence `manual` in Bazel;
# run it with `bazel test //tests/consumer:cmake_cpu_consumer_test` or directly.
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
root=$(cd "$here/../.." && pwd)
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
# shellcheck disable=SC1091
[ -f "$home/.cache/d9d/env" ] && source "$home/.cache/d9d/env"
[ -n "${D9D_TORCH_CMAKE_PREFIX:-}" ] || fail "no LibTorch: run tools/setup"
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/cmake-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
jobs=$(nproc)
# D9D_WITH_CUDA=OFF: a CPU LibTorch next to an installed nvcc would otherwise enable CUDA.
cmake -S "$root" -B "$work/d9d-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DD9D_WITH_CUDA=OFF \
  -DD9D_BUILD_TESTS=OFF -DD9D_BUILD_EXAMPLES=OFF -DD9D_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$D9D_TORCH_CMAKE_PREFIX" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; fail "configuring d9d"; }
cmake --build "$work/d9d-build" -j "$jobs" >"$work/build.log" 2>&1 ||
  { tail -n 50 "$work/build.log"; fail "building d9d"; }
cmake --install "$work/d9d-build" --prefix "$work/prefix" >/dev/null || fail "installing d9d"
cmake -S "$root/tests/cmake_consumer" -B "$work/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix;$D9D_TORCH_CMAKE_PREFIX" >"$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "configuring the consumer"; }
cmake --build "$work/consumer" >>"$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "building the consumer"; }
"$work/consumer/consumer" || fail "the consumer failed"
echo "ok"
