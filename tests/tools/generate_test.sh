#!/usr/bin/env bash
# tools/generate on a checkpoint written by transformers (tests/hf/fixtures/qwen3_tiny_untied):
# the greedy continuations of token-id prompts, batched, are transformers' (the `greedy` rows of
# its generation.safetensors, tests/hf/make_generation_fixture.py), and bad arguments are named.
set -uo pipefail
generate=$1
model=$2
fail() { echo "FAIL: $*" >&2; exit 1; }

out=$("$generate" --model "$model" --dtype float64 --max-new-tokens 16 \
  --ids "5 17 42 8 91 3 60" --ids "77 2 33" 2>&1) || fail "generate failed: $out"
expected="65 48 41 87 3 83 41 87 3 83 41 43 6 43 6 43 
37 23 20 23 20 23 67 43 15 69 55 39 66 9 3 35 "
[ "$out" = "$expected" ] || fail "continuations differ from transformers':
$out
expected:
$expected"

err=$("$generate" --model "$model" --prompt "hello" 2>&1) && fail "a text prompt on a 96-id model ran"
grep -q "byte tokenizer (258 ids), but the model's vocabulary has 96" <<<"$err" ||
  fail "unexpected message: $err"
err=$("$generate" --model "$model" --ids "1 x" 2>&1) && fail "a bad id ran"
grep -q '"x" is not a token id' <<<"$err" || fail "unexpected message: $err"
err=$("$generate" --model "$model" --ids "1 200" 2>&1) && fail "an id outside the vocabulary ran"
grep -q "token 200 at position 1" <<<"$err" || fail "unexpected message: $err"
err=$("$generate" --model "$model" 2>&1) && fail "no prompt ran"
grep -q "give --prompt" <<<"$err" || fail "unexpected message: $err"
echo "generate: all checks passed"
