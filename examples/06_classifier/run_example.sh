#!/usr/bin/env bash
# 06_classifier on 1 and 2 ranks, then a config with a typo on 2 ranks.
set -uo pipefail
d9drun=$1
example=$2
config=$3
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/classifier.XXXXXX")
fail() { echo "FAIL: $*"; exit 1; }

for ranks in 1 2; do
  out=$("$d9drun" -n "$ranks" "$example" "$config" --output "$work/run$ranks" --min-accuracy 0.9 2>&1)
  status=$?
  echo "$out"
  [ $status -eq 0 ] || fail "$ranks rank(s): the example exited with $status"
  grep -qF "[rank 0] [d9d rank 0/$ranks" <<<"$out" || fail "$ranks rank(s): no rank-0 line"
  grep -qE "accuracy (0\.9|1\.0)[0-9]* over 1024 samples" <<<"$out" || fail "$ranks rank(s): no accuracy line"
  grep -qF "model: $work/run$ranks/model (model.safetensors)" <<<"$out" ||
    fail "$ranks rank(s): the export line must name model.safetensors only"
  [ -f "$work/run$ranks/model/model.safetensors" ] || fail "$ranks rank(s): no model.safetensors"
  [ ! -e "$work/run$ranks/model/config.json" ] || fail "$ranks rank(s): a config.json was written"
  grep -qF '"train/samples_per_second"' "$work/run$ranks/metrics.jsonl" ||
    fail "$ranks rank(s): metrics.jsonl lacks train/samples_per_second"
  ! grep -qF 'tok/s' <<<"$out" || fail "$ranks rank(s): tokens counted for a model without tokens"
  # The task's metrics, synced over the ranks: in metrics.jsonl and on the result line.
  grep -qF '"metrics/cls/accuracy"' "$work/run$ranks/metrics.jsonl" ||
    fail "$ranks rank(s): metrics.jsonl lacks metrics/cls/accuracy"
  grep -qF '"metrics/cls/f1_macro"' "$work/run$ranks/metrics.jsonl" ||
    fail "$ranks rank(s): metrics.jsonl lacks metrics/cls/f1_macro"
  grep -qE "train accuracy (0\.9|1\.0)[0-9]*, macro F1 (0\.9|1\.0)" <<<"$out" ||
    fail "$ranks rank(s): no train accuracy and F1 line"
  for picture in lr_schedule loss; do
    grep -qF '</svg>' "$work/run$ranks/$picture.svg" || fail "$ranks rank(s): no $picture.svg"
  done
done

# A typo in the config: every rank reports the ConfigError once and exits 2, nothing aborts.
sed 's/"total_steps"/"total_step"/' "$config" >"$work/typo.json"
out=$("$d9drun" -n 2 "$example" "$work/typo.json" --output "$work/typo" 2>&1)
status=$?
echo "$out"
[ $status -eq 2 ] || fail "a config with a typo exited with $status, not 2 (134 is an abort)"
for rank in 0 1; do
  n=$(grep -cF "[rank $rank] [d9d rank $rank/2] error: d9d config: unknown key \"run.total_step\"" <<<"$out")
  [ "$n" -eq 1 ] || fail "rank $rank reported the typo $n times, not once"
done
! grep -qiE "terminate called|Aborted|core dumped" <<<"$out" || fail "a rank aborted"
echo "ok"
