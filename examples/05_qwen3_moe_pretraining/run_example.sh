#!/usr/bin/env bash
# 05_qwen3_moe_pretraining on 2 ranks with ep 2: the repository's docs as the corpus, 40 steps,
# with the advisor's pre-flight.
set -uo pipefail
d9drun=$1
example=$2
tokenize=$3
config=$4
work=${TEST_TMPDIR:-$(mktemp -d)}
"$tokenize" --out "$work/corpus.bin" --width u16 README.md docs/*.md docs/design/*.md || {
  echo "FAIL: tokenizing the docs"
  exit 1
}
# With an "advise" section: the advisor's pre-flight for the MoE Plan is printed first.
sed '1a\  "advise": {"enabled": true},' "$config" >"$work/config.json"
out=$(OMP_NUM_THREADS=1 "$d9drun" -n 2 "$example" "$work/config.json" --data "$work/corpus.bin" \
  --output "$work/run" --steps 40 2>&1)
status=$?
echo "$out"
[ $status -eq 0 ] || { echo "FAIL: the example exited with $status"; exit 1; }
for want in "mesh (pp=1 dp_replicate=1 dp_shard=2 cp_replicate=1 cp_shard=1 tp=1 ep=2)" \
            "step    0  loss " "| router load max/mean " "dropped 0" "active per token" \
            "advise: fully_shard dp_shard 2, 2 microbatches, ep 2; predicted for the fullest rank: state " \
            "(experts at their balanced load), peak during a step "; do
  grep -qF -- "$want" <<<"$out" || { echo "FAIL: output lacks '$want'"; exit 1; }
done
# The loss falls (first and last of "loss: a -> b").
read -r first last < <(sed -n 's/.*loss: \([0-9.]*\) -> \([0-9.]*\);.*/\1 \2/p' <<<"$out" | head -1)
[ -n "${first:-}" ] || { echo "FAIL: no final loss line"; exit 1; }
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1.0) }' ||
  { echo "FAIL: the loss did not fall by 1 ($first -> $last)"; exit 1; }
[ -f "$work/run/model/model.safetensors" ] || { echo "FAIL: no exported model"; exit 1; }
grep -q '"moe/load_max_over_mean"' "$work/run/metrics.jsonl" ||
  { echo "FAIL: the router balance is not in metrics.jsonl"; exit 1; }
[ -f "$work/run/router_balance.svg" ] || { echo "FAIL: no router_balance.svg"; exit 1; }
grep -q '"moe/load_max_over_mean/layer_0"' "$work/run/metrics.jsonl" ||
  { echo "FAIL: the first layer's balance is not in metrics.jsonl"; exit 1; }
# The picture, for a look (Bazel keeps it in the test's outputs.zip).
[ -z "${TEST_UNDECLARED_OUTPUTS_DIR:-}" ] || cp "$work/run/router_balance.svg" "$TEST_UNDECLARED_OUTPUTS_DIR/"
echo "ok"
