#!/usr/bin/env bash
# The Bazel route of docs/consuming.md: tests/consumer/bazel is a user's workspace with d9d as a
# local_repository pointing at this checkout. In a clean temporary directory, a nested Bazel
# (--batch, its own output root, the shared disk cache) analyses the user's whole build (d9d's
# BUILD files and repository rules seen from outside, LibTorch through @torch) and compiles the
# user's main.cpp against @d9d's headers. It does not compile d9d's ~85 files again: there their
# actions would be keyed by external/d9d paths and share no cache entry with this checkout's build
# (they cost 9 minutes of a cold CI run). The linked program is //tests/consumer:consumer, the same
# main.cpp against the same targets (@d9d//:d9d is //:d9d here), passed as $1: its output and the
# status of a configuration error are checked.
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
[ $# -eq 1 ] || fail "usage: $0 CONSUMER_PROGRAM"
program=$(readlink -f "$1")
[ -x "$program" ] || fail "no consumer program at $1"
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
# The output group compilation_outputs: the object files of the consumer's own sources only.
bazel --batch --output_user_root="$work/bazel-root" build //:consumer \
  --output_groups=compilation_outputs \
  --disk_cache="$cache" --repo_env=D9D_TORCH_DIR="${D9D_TORCH_DIR:-}" --color=no --curses=no \
  --show_progress_rate_limit=60 >"$work/bazel.log" 2>&1
status=$?
tail -n 20 "$work/bazel.log"
[ $status -eq 0 ] || fail "the consumer's workspace did not analyse and compile"
objects=$(find -L bazel-bin/_objs/consumer -name 'main.*o' 2>/dev/null | wc -l)
[ "$objects" -ge 1 ] || fail "no object file of main.cpp under bazel-bin/_objs/consumer"
[ -d bazel-bin/external/d9d/_objs ] && fail "the nested build compiled d9d's library files"

out=$("$program" 2>&1)
echo "$out"
grep -qF "d9d consumer: ok" <<<"$out" || fail "the consumer did not report ok"
out=$("$program" --typo 2>&1)
status=$?
echo "$out"
[ $status -eq 2 ] || fail "the config typo gave status $status, not 2"
grep -qF 'error: d9d config: unknown key "run.total_step"' <<<"$out" || fail "no config error line"
echo "ok"
