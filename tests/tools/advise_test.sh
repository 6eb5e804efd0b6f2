#!/usr/bin/env bash
# tools/advise on the quickstart's config (a tied 4-layer Qwen3, vocabulary 258): FullyShard's
# shards add up to Replicate's bytes (258 rows over 3 ranks: 86 each), bfloat16 parameters halve
# the parameter and gradient bytes, a pipeline's ranks add up to the whole model plus the tied
# head's copy of the embedding, fp32's activations of a microbatch are the formula's (and are not
# claimed where they are not predicted), --candidates lists and counts the Plan shapes for a
# world, with a machine profile the step time and the ranking, LoRA's prediction (--lora), a
# Qwen3-MoE's state under expert parallelism, and bad input is named with a non-zero status.
set -uo pipefail
tool=$1
config=$2
profile=$3
moe_config=$4
fail() { echo "FAIL: $*" >&2; exit 1; }
column() {  # the n-th byte count (1 parameters, 2 gradients, 3 moments, 4 total) summed over ranks
  awk -v n="$1" '/^  pp [0-9]+, shard [0-9]+:/ {s += $(4 + n)}
    /^  pp [0-9]+, shard [0-9]+, expert shard [0-9]+:/ {s += $(7 + n)} END {print s}'
}
whole=$("$tool" --config "$config") || fail "advise failed"
sharded=$("$tool" --config "$config" --data-parallel fully_shard --dp-shard 3) ||
  fail "advise --dp-shard 3 failed"
[ "$(echo "$sharded" | grep -c '^  pp 0, shard ')" = 3 ] || fail "not 3 shard lines: $sharded"
for n in 1 2 3 4; do
  [ "$(echo "$whole" | column $n)" = "$(echo "$sharded" | column $n)" ] ||
    fail "column $n: the shards do not add up to the whole: $whole / $sharded"
done
half=$("$tool" --config "$config" --precision bf16_params) || fail "bf16_params failed"
[ $(($(echo "$whole" | column 1) / 2)) = "$(echo "$half" | column 1)" ] ||
  fail "bfloat16 parameters are not half: $half"
[ "$(echo "$whole" | column 3)" = "$(echo "$half" | column 3)" ] ||
  fail "stochastic rounding's float32 moments changed: $half"
# pp 2 with a tied head: the last stage holds a copy of the 258 x 256 embedding (float32).
piped=$("$tool" --config "$config" --pp 2 --schedule 1f1b --microbatches 4) || fail "pp 2 failed"
[ $(($(echo "$whole" | column 1) + 258 * 256 * 4)) = "$(echo "$piped" | column 1)" ] ||
  fail "the stages do not add up to the whole model and the tied copy: $piped"
grep -q '^largest: ' <<<"$piped" || fail "no largest line: $piped"
# pp 2 in bf16_mixed: each rank's microbatches in flight (1F1B: rank 0 holds two, rank 1 one).
grep -q '^  pp 1: [0-9]' <<<"$piped" || fail "no activations in flight: $piped"
# tp 2, fp32: one rank's activations. Per token of a layer 1,866 floats over every token (the
# norms' outputs, its 4 of 8 heads, 384 of 768 MLP columns) and 514 over the residual stream's;
# per token 9 bytes of the vocabulary-parallel embedding's ids and mask, the stream's embedding
# output and final rstd (1,028), the head's input (1,024) and the loss-parallel softmax over
# 129 words (516). Sequence parallelism splits the stream's part over the 2 ranks.
tp2=$("$tool" --config "$config" --precision fp32 --tp 2) || fail "tp 2 failed"
want=$(( 4 * 2048 * (1866 + 514) * 4 + 2048 * (9 + 1028 + 1024 + 516) + 2 * 256 * 16 * 4 ))
grep -q "^activations of a microbatch: $want " <<<"$tp2" || fail "tp 2 is not $want: $tp2"
sp2=$("$tool" --config "$config" --precision fp32 --tp 2 --sequence-parallel) ||
  fail "--sequence-parallel failed"
want=$(( 4 * 2048 * (1866 * 4 + 514 * 4 / 2) + 2048 * (9 + 1028 / 2 + 1024 + 516) + 2 * 256 * 16 * 4 ))
grep -q "^activations of a microbatch: $want " <<<"$sp2" ||
  fail "tp 2 with sequence parallelism is not $want: $sp2"
# fp32, one microbatch of 8 x 256 tokens: per token of a layer 3,734 floats (hidden 256, q 256,
# kv 128, intermediate 768, 8/4 heads), 4 layers; embedding, rstd and head input gradient (513
# floats) per token and the head's 258 x 256 weight gradient; rotary tables 2 x 256 x 16.
fp32=$("$tool" --config "$config" --precision fp32) || fail "fp32 failed"
want=$(( (4 * 3734 * 2048 + 513 * 2048 + 258 * 256 + 2 * 256 * 16) * 4 ))
grep -q "^activations of a microbatch: $want " <<<"$fp32" ||
  fail "activations are not $want: $fp32"
# Full recompute: each of the 4 layers keeps its output only (float32, 2,048 tokens x 256).
full=$("$tool" --config "$config" --precision fp32 --recompute full) || fail "--recompute failed"
want=$(( (4 * 256 * 2048 + 513 * 2048 + 258 * 256 + 2 * 256 * 16) * 4 ))
grep -q "^activations of a microbatch: $want " <<<"$full" ||
  fail "recomputed activations are not $want: $full"
# Every other layer (layers 1 and 3): two keep everything, two their output.
every=$("$tool" --config "$config" --precision fp32 --recompute full --recompute-every 2) ||
  fail "--recompute-every failed"
want=$(( (2 * 3734 * 2048 + 2 * 256 * 2048 + 513 * 2048 + 258 * 256 + 2 * 256 * 16) * 4 ))
grep -q "^activations of a microbatch: $want " <<<"$every" ||
  fail "every other layer recomputed is not $want: $every"
# Selective recompute: each layer keeps its MLP part and output (3 x 256 + 1 + 2 x 768 floats).
selective=$("$tool" --config "$config" --precision fp32 --recompute attention) ||
  fail "--recompute attention failed"
want=$(( (4 * 2305 * 2048 + 513 * 2048 + 258 * 256 + 2 * 256 * 16) * 4 ))
grep -q "^activations of a microbatch: $want " <<<"$selective" ||
  fail "attention recomputed is not $want: $selective"
# --candidates: the header's count is the number of Plans listed, and the summary counts the
# lines marked as not fitting (state + predicted activations above --memory-gib).
listed=$("$tool" --config "$config" --candidates 2 --precision fp32 --memory-gib 0.1) ||
  fail "--candidates failed"
count=$(echo "$listed" | sed -n 's/^\([0-9][0-9]*\) candidate Plans for 2 ranks.*/\1/p')
[ -n "$count" ] && [ "$count" = "$(echo "$listed" | grep -c '^  [rf]')" ] ||
  fail "the count is not the lines: $listed"
marked=$(echo "$listed" | grep -c '(does not fit)')
[ "$marked" -ge 1 ] && grep -q "^$marked of $count do not fit in 0.1 GiB" <<<"$listed" ||
  fail "the summary does not count the marked lines: $listed"
grep -q '^  replicate pp 2 (1f1b), 2 microbatches ' <<<"$listed" || fail "no 1f1b pp 2: $listed"
# --lora 4: the pre-flight's prediction for LoRA on every linear layer but the head (the state with
# the adapters and the frozen base, the activations and the peak; with the profile the step): its
# peak below full training's in the same precision (no gradients or moments for the frozen base),
# and FullyShard refused by name.
lora=$("$tool" --config "$config" --precision bf16_params --lora 4 --profile "$profile") ||
  fail "--lora failed"
lora_peak=$(sed -nE 's/^advise: replicate \(one rank\), 2 microbatches; predicted .*, peak during a step ([0-9.]+) GiB.*/\1/p' <<<"$lora")
[ -n "$lora_peak" ] || fail "no LoRA state and peak: $lora"
grep -q '^advise: predicted step on NVIDIA H200: ' <<<"$lora" || fail "no LoRA step: $lora"
full_peak=$("$tool" --config "$config" --precision bf16_params |
  sed -nE 's/^peak during a step: ([0-9.]+) GiB.*/\1/p')
awk -v l="$lora_peak" -v f="$full_peak" 'BEGIN {exit !(l < f)}' ||
  fail "LoRA's peak $lora_peak GiB is not below full training's $full_peak GiB"
"$tool" --config "$config" --lora 4 --data-parallel fully_shard --dp-shard 2 \
  >"${TEST_TMPDIR:-/tmp}/err" 2>&1 && fail "--lora under FullyShard was not refused"
grep -q -- '--lora: predicted under replicate' "${TEST_TMPDIR:-/tmp}/err" ||
  fail "$(cat "${TEST_TMPDIR:-/tmp}/err")"
# --profile (the committed one-H200 profile): the step's line, its tokens/s the step's tokens over
# its time; ranked candidates fastest first, written as JSON; two ranks need measured collectives.
timed=$("$tool" --config "$config" --profile "$profile") || fail "--profile failed"
line=$(echo "$timed" | grep '^step time on NVIDIA H200: ') || fail "no step time: $timed"
echo "$line" | awk '{ms = $(NF - 7); tps = $(NF - 5); tok = substr($(NF - 3), 2)
  if (tok != 4096 || ms <= 0 || (tok / (ms / 1000) / tps - 1) ^ 2 > 1e-5) exit 1}' ||
  fail "tokens/s is not the step's tokens over its time: $line"
ranked=$("$tool" --config "$config" --candidates 1 --profile "$profile" \
  --json "${TEST_TMPDIR:-/tmp}/ranking.json") || fail "--candidates --profile failed"
echo "$ranked" | awk '/^  [rf].* step / {t = $(NF - 1); if (seen && t > last + 0.5) exit 1; last = t; seen = 1}
  END {if (!seen) exit 1}' || fail "not fastest first: $ranked"
[ "$(grep -c '"tokens_per_second"' "${TEST_TMPDIR:-/tmp}/ranking.json")" = \
  "$(echo "$ranked" | grep -c '^  [rf]')" ] || fail "the JSON does not list every Plan"
"$tool" --config "$config" --dp-shard 2 --profile "$profile" >"${TEST_TMPDIR:-/tmp}/err" 2>&1 &&
  fail "two ranks were timed without measured collectives"
grep -q 'no measured all_reduce (profiled on 1 GPU(s)' "${TEST_TMPDIR:-/tmp}/err" ||
  fail "$(cat "${TEST_TMPDIR:-/tmp}/err")"
"$tool" --config "$config" --pp 2 --schedule nope >"${TEST_TMPDIR:-/tmp}/err" 2>&1 &&
  fail "an unknown schedule was accepted"
grep -q 'unknown schedule "nope"' "${TEST_TMPDIR:-/tmp}/err" || fail "$(cat "${TEST_TMPDIR:-/tmp}/err")"
"$tool" --config "$config" --tp 3 >"${TEST_TMPDIR:-/tmp}/err" 2>&1 && fail "tp 3 was accepted"
grep -q 'does not split over 3 tensor ranks' "${TEST_TMPDIR:-/tmp}/err" ||
  fail "$(cat "${TEST_TMPDIR:-/tmp}/err")"
# A Qwen3-MoE (example 05's CPU config: 4 layers of 8 experts, hidden 128, expert size 128):
# ep 2 leaves each rank half of the experts' 4 x 8 x 3 x 128 x 128 floats, and FullyShard 4 x ep 2
# shards the rest over 4 and the experts over ep_replicate 2 (each rank a quarter of them).
moe=$("$tool" --config "$moe_config" --precision fp32) || fail "the MoE config failed"
ep2=$("$tool" --config "$moe_config" --precision fp32 --ep 2 --dp-shard 2) || fail "--ep 2 failed"
experts=$(( 4 * 8 * 3 * 128 * 128 * 4 ))
[ $(($(echo "$moe" | column 1) - experts / 2)) = "$(echo "$ep2" | column 1)" ] ||
  fail "ep 2 does not halve the experts: $moe / $ep2"
sharded=$("$tool" --config "$moe_config" --precision fp32 --ep 2 --dp-shard 4 \
  --data-parallel fully_shard) || fail "--ep 2 --dp-shard 4 failed"
[ "$(echo "$sharded" | grep -c '^  pp 0, shard [0-3], expert shard [01]:')" = 4 ] ||
  fail "not one line per rank: $sharded"
[ "$(echo "$moe" | column 1)" = "$(echo "$sharded" | column 1)" ] ||
  fail "4 ranks do not hold the model once (the experts split over ep and ep_replicate): $sharded"
grep -q '^not predicted yet for a MoE model: the peak during a step' <<<"$sharded" ||
  fail "the MoE output claims a peak with the experts sharded over ep_replicate: $sharded"
# With the committed one-H200 profile (its grouped_experts measured at example 05's GPU shape): the
# MoE step's time and its routed experts; expert parallelism needs measured all-to-alls.
moe_timed=$("$tool" --config "$moe_config" --precision bf16_params --profile "$profile") ||
  fail "the MoE step time failed"
grep -q '^step time on NVIDIA H200: ' <<<"$moe_timed" || fail "no MoE step time: $moe_timed"
grep -qE '^  of which the routed experts [0-9.]+ ms, expert parallelism.s all-to-alls 0.0 ms' <<<"$moe_timed" ||
  fail "no routed experts, or all-to-alls without ep: $moe_timed"
"$tool" --config "$moe_config" --precision bf16_params --ep 2 --dp-shard 2 --profile "$profile" \
  >"${TEST_TMPDIR:-/tmp}/err" 2>&1 && fail "ep 2 was timed without measured all-to-alls"
grep -q 'no measured all_to_all' "${TEST_TMPDIR:-/tmp}/err" || fail "$(cat "${TEST_TMPDIR:-/tmp}/err")"
# Its activations and peak (d9d::advise::qwen3_moe_activation_bytes, measured in
# tests/advise): the experts' rows grow with --expert-load, and the peak holds the state and them.
kept() { echo "$1" | sed -n 's/^activations of a microbatch ([^)]*): \([0-9]*\) .*/\1/p'; }
balanced=$(kept "$ep2")
loaded=$(kept "$("$tool" --config "$moe_config" --precision fp32 --ep 2 --dp-shard 2 \
  --expert-load 2)")
[ -n "$balanced" ] && [ -n "$loaded" ] && [ "$loaded" -gt "$balanced" ] ||
  fail "--expert-load 2 does not add rows: $balanced / $loaded"
grep -q '^peak during a step: ' <<<"$ep2" || fail "no MoE peak: $ep2"
piped=$("$tool" --config "$moe_config" --precision fp32 --pp 2) || fail "the MoE pipeline failed"
grep -q '^not predicted yet for a MoE model under a pipeline: activations' <<<"$piped" ||
  fail "a MoE pipeline claims its activations: $piped"
"$tool" --config "$config" --ep 2 >"${TEST_TMPDIR:-/tmp}/err" 2>&1 && fail "--ep on a dense model"
grep -q 'a dense Qwen3 (no experts)' "${TEST_TMPDIR:-/tmp}/err" || fail "$(cat "${TEST_TMPDIR:-/tmp}/err")"
echo "advise_test: ok"
