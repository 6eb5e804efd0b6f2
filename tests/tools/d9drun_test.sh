#!/usr/bin/env bash
# tools/d9drun: a program that cannot start is a one-line error (no Python traceback) with the
# shell's statuses 127 (missing) and 126 (not executable); a working program still runs per rank.
set -uo pipefail
d9drun=$1
fail() { echo "FAIL: $*"; exit 1; }
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/d9drun.XXXXXX")

check_one_line() {  # status wanted, text wanted, command...
  local want_status=$1 want_text=$2
  shift 2
  local out status
  out=$("$@" 2>&1)
  status=$?
  echo "$out"
  [ "$status" -eq "$want_status" ] || fail "'$*' exited with $status, not $want_status"
  [ "$(wc -l <<<"$out")" -eq 1 ] || fail "'$*' printed more than one line"
  grep -qF -- "$want_text" <<<"$out" || fail "'$*' did not say '$want_text'"
  ! grep -qF "Traceback" <<<"$out" || fail "'$*' printed a traceback"
}

check_one_line 127 "d9drun: error: cannot start '$work/missing': no such file" \
  "$d9drun" -n 2 "$work/missing"
check_one_line 127 "d9drun: error: cannot start 'no-such-program-d9d': no such file on PATH" \
  "$d9drun" -n 2 no-such-program-d9d
printf 'not a program\n' >"$work/plain"
chmod -x "$work/plain"
check_one_line 126 "d9drun: error: cannot start '$work/plain'" "$d9drun" -n 2 "$work/plain"

out=$("$d9drun" -n 2 /bin/sh -c 'echo "rank $RANK of $WORLD_SIZE"' 2>&1) || fail "a working program failed"
grep -qF "[rank 1] rank 1 of 2" <<<"$out" || fail "rank 1 did not run: $out"
# --cpu-bind cores: each rank on its own physical cores (disjoint sets within d9drun's own), its
# OMP_NUM_THREADS their count; with fewer cores than ranks, one line says so and nothing is bound.
allowed=$(python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))')
show='import os; print("cpus", sorted(os.sched_getaffinity(0)), "omp", os.environ.get("OMP_NUM_THREADS"))'
cores=$(python3 -c '
import os
seen = set()
for cpu in os.sched_getaffinity(0):
    t = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        seen.add((open(t + "/physical_package_id").read(), open(t + "/core_id").read()))
    except OSError:
        seen.add(("", cpu))
print(len(seen))')
out=$(env -u OMP_NUM_THREADS "$d9drun" -n 1 --cpu-bind cores python3 -c "$show" 2>&1) || fail "one bound rank failed: $out"
grep -qF "[rank 0] cpus $allowed omp $cores" <<<"$out" || fail "one rank should get every core ($allowed, omp $cores): $out"
out=$(env -u OMP_NUM_THREADS "$d9drun" -n 2 --cpu-bind cores python3 -c "$show" 2>&1) || fail "two bound ranks failed: $out"
if [ "$cores" -ge 2 ]; then
  python3 - "$allowed" "$out" <<'PY' || fail "two ranks' cores: $out"
import ast, re, sys
allowed = set(ast.literal_eval(sys.argv[1]))
sets = {int(r): set(ast.literal_eval(c)) for r, c in re.findall(r"\[rank (\d)\] cpus (\[[^]]*\])", sys.argv[2])}
assert sorted(sets) == [0, 1], sets
assert sets[0] and sets[1] and not sets[0] & sets[1], sets
assert sets[0] | sets[1] <= allowed, sets
PY
else
  grep -qF "[d9drun] --cpu-bind cores: $cores physical core(s) for 2 ranks; binding nothing" <<<"$out" ||
    fail "fewer cores than ranks should be said: $out"
fi
out=$(OMP_NUM_THREADS=3 "$d9drun" -n 1 --cpu-bind cores python3 -c "$show" 2>&1) || fail "$out"
grep -qF "omp 3" <<<"$out" || fail "a set OMP_NUM_THREADS should stay: $out"
echo "ok"
