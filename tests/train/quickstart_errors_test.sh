#!/usr/bin/env bash
# The quickstart binary (examples/03_qwen3_quickstart) with bad input: every case exits with status 2
# (a configuration error) or 1 (any other error) and one clear message, never std::terminate (134)
# or a crash; a good run of one step exits 0. On several ranks, the cause comes first in the job's
# output, before any rank's "job failed" line.
set -uo pipefail
quickstart=$1
d9drun=$2  # tools/d9drun, for the cases on several ranks
dir=${TEST_TMPDIR:-/tmp}/quickstart-errors-$$
mkdir -p "$dir"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A tiny model and batch (one step takes well under a second); $1: extra top-level JSON.
config() {
  cat <<JSON
{
  "run": {"output_dir": "$dir/run", "total_steps": 1, "seed": 1},
  "batch": {"global_batch_size": 2, "microbatch_size": 1, "sequence_length": 8},
  "logging": {"progress": false, "jsonl": false, "tensorboard": false},
  "export": {"enabled": false},
  "model": {"vocab_size": 258, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false}$1
}
JSON
}
# 64 u16 tokens, ids 0..63 (little-endian), then optionally one more id (in hex bytes).
tokens() {
  for ((i = 0; i < 64; ++i)); do printf "\\x$(printf %02x $i)\\x00"; done
  [ $# -eq 0 ] || printf "%b" "$1"
}
tokens >"$dir/good.bin"
tokens '\x2c\x01' >"$dir/id300.bin"  # id 300 >= vocab_size 258
config "" >"$dir/good.json"
config ', "mesh": {"pp": 4294967297}' >"$dir/pp_overflow.json"
config ', "optimizer": {"lr": 1e999}' >"$dir/lr_overflow.json"
config ', "optimizer": {"lr": 0.1}, "optimizer": {"lr": 0.2}' >"$dir/twice.json"
config "" | sed 's/"global_batch_size": 2, "microbatch_size": 1/"global_batch_size": 3, "microbatch_size": 2/' \
  >"$dir/indivisible.json"
printf '{"run": ' >"$dir/truncated.json"
config ', "advise": {"memory": 80}' >"$dir/advise_typo.json"
config ', "advise": {"memory_gib": 1e-6}' >"$dir/advise_small.json"

# expect <status> <message substring> <quickstart arguments...>
expect() {
  local want=$1 message=$2
  shift 2
  local out status
  out=$("$quickstart" "$@" 2>&1)
  status=$?
  echo "--- quickstart $* -> $status"
  echo "$out"
  [ "$status" -eq "$want" ] || fail "quickstart $*: status $status, expected $want"
  grep -qF -- "$message" <<<"$out" || fail "quickstart $*: no \"$message\" in the output"
  if grep -qE "terminate called|Aborted|core dumped" <<<"$out"; then
    fail "quickstart $*: terminated"
  fi
}

expect 0 "loss:" "$dir/good.json" --data "$dir/good.bin"
expect 2 "cannot read \"$dir/missing.json\"" "$dir/missing.json" --data "$dir/good.bin"
expect 2 "not valid JSON" "$dir/truncated.json" --data "$dir/good.bin"
expect 2 "\"mesh.pp\" = 4294967297 is invalid: expected an integer from 1 to 2147483647" \
  "$dir/pp_overflow.json" --data "$dir/good.bin"
expect 2 "number overflow" "$dir/lr_overflow.json" --data "$dir/good.bin"
expect 2 "\"optimizer\" appears twice" "$dir/twice.json" --data "$dir/good.bin"
expect 2 "--pp 2 needs a pipeline schedule" "$dir/good.json" --data "$dir/good.bin" --pp 2
expect 2 "not below the model's vocabulary size 258" "$dir/good.json" --data "$dir/id300.bin"
expect 2 "cannot open" "$dir/good.json" --data "$dir/missing.bin"
expect 2 "is not divisible by data-parallel ranks" "$dir/indivisible.json" --data "$dir/good.bin"
# The advisor's pre-flight: a bad key is a config error; a prediction above memory_gib warns and
# the run goes on; with an indivisible batch the Trainer's error is the one shown.
expect 2 "advise.memory: unknown key (advise takes enabled, memory_gib, profile)" \
  "$dir/advise_typo.json" --data "$dir/good.bin"
expect 0 "advise: warning: the prediction exceeds memory_gib" "$dir/advise_small.json" \
  --data "$dir/good.bin"
# A pipeline of 2 stages in a world of 1 rank: the mesh does not fit the world.
expect 2 "d9d config: d9d::mesh: " "$dir/good.json" --data "$dir/good.bin" --pipeline 1f1b --pp 2
# Tensor parallelism: one rank cannot hold a sequence-parallel tp mesh; --tp is compiled alone.
expect 2 "sequence parallelism needs \"mesh.tp\" > 1 (got 1)" "$dir/good.json" --data "$dir/good.bin" --tp
expect 2 "--tp is compiled alone or with --bf16" "$dir/good.json" --data "$dir/good.bin" --tp --fsdp
# tp over 3 ranks of a model with 2 attention heads: every rank stops on the configuration error
# (status 2, naming the key and the model's value), and it is the first error in the job's output:
# no rank's watchdog says "job failed" before it.
out=$("$d9drun" -n 3 "$quickstart" "$dir/good.json" --data "$dir/good.bin" --tp 2>&1)
status=$?
echo "--- d9drun -n 3 quickstart --tp -> $status"
echo "$out"
[ "$status" -eq 2 ] || fail "tp 3 over 2 heads: status $status, expected 2"
cause='"mesh.tp" = 3 does not divide the model'"'"'s "num_attention_heads" = 2'
for rank in 0 1 2; do
  grep -qF -- "$cause" <<<"$(grep -F "[d9d rank $rank/3" <<<"$out")" ||
    fail "rank $rank did not report: $cause"
done
first=$(grep -m1 -E 'error: |job failed' <<<"$out")
grep -qF -- "$cause" <<<"$first" || fail "the first error line is not the cause: $first"

# The command line's own errors (CLI11): status 105 for a value out of range.
expect 105 "--pp" "$dir/good.json" --pp 0

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "ok"
