#!/usr/bin/env bash
# tools/gpu/smi_windows.py: per run and GPU, the medians over the run's busy samples (power above a
# third of the run's highest) and the clock-event reasons other than idle; samples outside every
# run's window and malformed lines are left out.
set -uo pipefail
script=$1
fail() { echo "FAIL: $*"; exit 1; }
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/smi_windows.XXXXXX")
at() { python3 -c "import datetime; print(datetime.datetime(2026, 11, 30, 15, 0, $1).timestamp())"; }
cat >"$work/smi.csv" <<'CSV'
2026/11/30 15:00:01.000, 0, 1900, 650.0, 60, 0x0000000000000004
2026/11/30 15:00:01.000, 1, 345, 80.0, 35, 0x0000000000000001
2026/11/30 15:00:02.000, 0, 1800, 690.0, 62, 0x0000000000000004
2026/11/30 15:00:02.000, 1, 345, 79.0, 35, 0x0000000000000001
2026/11/30 15:00:03.000, 0, 1980, 100.0, 50, 0x0000000000000000
not a sample
2026/11/30 15:00:08.000, 0, 1200, 700.0, 80, 0x0000000000000040
CSV
printf 'a start %s\na end %s\n' "$(at 0)" "$(at 5)" >"$work/windows.txt"
out=$(python3 "$script" "$work/smi.csv" "$work/windows.txt") || fail "the script failed"
echo "$out"
# GPU 0: the 100 W sample is idle (below 690 / 3), so the median of 1900 and 1800.
grep -qF "| a | 0 | 2 | 1850 | 670 | 61 | 0x0000000000000004 |" <<<"$out" || fail "GPU 0's row"
# GPU 1: every sample busy for its own highest power; idle reason 0x1 is not listed.
grep -qF "| a | 1 | 2 | 345 | 80 | 35 | - |" <<<"$out" || fail "GPU 1's row"
# The sample at 15:00:08 is outside the window.
! grep -qF "0x0000000000000040" <<<"$out" || fail "a sample outside the run was counted"
echo "PASS"
