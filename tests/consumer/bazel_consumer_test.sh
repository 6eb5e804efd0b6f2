#!/usr/bin/env bash
# Builds tests/consumer as a user's Bazel workspace in a clean temporary directory, with d9d as a
# local_repository pointing at this checkout, then runs the program (docs/consuming.md).
# The nested Bazel shares d9d's disk cache (~/.cache/d9d/bazel-disk-cache), so only its first run
# compiles the library (about 45 files); later runs take about a minute. Needs no sandbox (it
# writes the disk cache) and runs Bazel in --batch mode (no server is left behind).
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
root=$(cd "$here/../.." && pwd)
[ -f "$root/WORKSPACE" ] || fail "cannot find the d9d checkout from $here"
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
# shellcheck disable=SC1091
[ -f "$home/.cache/d9d/env" ] && source "$home/.cache/d9d/env"
cache=${D9D_HOME:-$home/.cache/d9d}/bazel-disk-cache
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/project"
sed "s|@D9D@|$root|g" "$here/bazel/WORKSPACE.consumer" >"$work/project/WORKSPACE"
cp "$here/bazel/BUILD.consumer" "$work/project/BUILD"
cp "$here/bazel/bazelrc.consumer" "$work/project/.bazelrc"
cp "$here/main.cpp" "$work/project/main.cpp"
cd "$work/project" || fail "no project directory"
bazel --batch --output_user_root="$work/bazel-root" build //:consumer \
  --disk_cache="$cache" --repo_env=D9D_TORCH_DIR="${D9D_TORCH_DIR:-}" --color=no --curses=no \
  --show_progress_rate_limit=60 2>&1 | tail -n 20
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "the consumer did not build"
out=$(./bazel-bin/consumer 2>&1)
echo "$out"
grep -qF "d9d consumer: ok" <<<"$out" || fail "the consumer did not report ok"
out=$(./bazel-bin/consumer --typo 2>&1)
status=$?
echo "$out"
[ $status -eq 2 ] || fail "the config typo gave status $status, not 2"
grep -qF 'error: d9d config: unknown key "run.total_step"' <<<"$out" || fail "no config error line"
echo "ok"
