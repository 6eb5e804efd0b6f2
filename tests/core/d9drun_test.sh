#!/usr/bin/env bash
# tools/d9drun with real processes (bash ranks): every rank's output is kept in <log dir>/rank<r>.log,
# a rank that fails (exits non-zero, or is killed) is named at once and the others, which would
# sleep for 10 minutes, are killed after --grace: the test would otherwise outlive Bazel's timeout.
set -uo pipefail
d9drun=$1
logs=${TEST_TMPDIR:-/tmp}/d9drun-test-$$
fail() { echo "FAIL: $*"; exit 1; }

# All ranks succeed: status 0, one log per rank with that rank's lines.
out=$("$d9drun" -n 3 --log-dir "$logs/ok" bash -c 'echo "hello from $RANK of $WORLD_SIZE"' 2>&1)
status=$?
echo "$out"
[ $status -eq 0 ] || fail "a successful run exited with $status"
for rank in 0 1 2; do
  grep -qx "hello from $rank of 3" "$logs/ok/rank$rank.log" || fail "rank$rank.log lacks its line"
  grep -qF "[rank $rank] hello from $rank of 3" <<<"$out" || fail "no prefixed line of rank $rank"
done

# Rank 1 exits with 3 while the others sleep: d9drun names rank 1, kills the others, exits 3.
out=$("$d9drun" -n 3 --grace 1 --log-dir "$logs/exit" bash -c \
  'echo "rank $RANK up"; if [ "$RANK" = 1 ]; then echo "giving up" >&2; exit 3; fi; exec sleep 600' 2>&1)
status=$?
echo "$out"
[ $status -eq 3 ] || fail "a run whose rank 1 exited with 3 exited with $status"
grep -qF "[d9drun] rank 1 exited with status 3" <<<"$out" || fail "rank 1 is not named"
grep -qx "giving up" "$logs/exit/rank1.log" || fail "rank1.log lacks the rank's error"
for rank in 0 2; do
  grep -qx "rank $rank up" "$logs/exit/rank$rank.log" || fail "rank$rank.log lacks its line"
done

# Rank 2 is killed (SIGKILL): status 137, named with the signal.
out=$("$d9drun" -n 3 --grace 1 --log-dir "$logs/kill" bash -c \
  'if [ "$RANK" = 2 ]; then kill -9 $$; fi; exec sleep 600' 2>&1)
status=$?
echo "$out"
[ $status -eq 137 ] || fail "a run whose rank 2 was killed exited with $status"
grep -qF "[d9drun] rank 2 was killed by SIGKILL" <<<"$out" || fail "rank 2 is not named"
echo "ok"
