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
echo "ok"
