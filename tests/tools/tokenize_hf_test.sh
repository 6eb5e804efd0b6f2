#!/usr/bin/env bash
# tools/tokenize-hf with a tokenizer trained here (Hugging Face tokenizers, WordLevel, saved as a
# transformers tokenizer directory): text and JSONL documents give exactly the tokenizer's ids,
# each document followed by the eos id, as little-endian u16 and u32; bad input is named and
# leaves no output. Needs D9D_HF_PYTHON (tools/test passes it).
set -uo pipefail
tool=$1
python=${D9D_HF_PYTHON:?"D9D_HF_PYTHON is not set (tools/test passes it; tools/setup writes it)"}
dir=${TEST_TMPDIR:-$(mktemp -d)}/tokenize_hf
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "FAIL: $*" >&2; exit 1; }

printf 'the cat sat\non the mat\n' >"$dir/a.txt"
printf '{"text": "the mat sat"}\n\n{"text": "a cat", "other": 1}\n' >"$dir/b.jsonl"
"$python" - "$dir" <<'PY' || fail "could not build the test tokenizer"
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = ["[UNK]", "</s>", "the", "cat", "sat", "on", "mat", "a"]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                        eos_token="</s>").save_pretrained(sys.argv[1] + "/tok")
PY

check() {  # width, expected ids
  local width=$1 expected=$2
  "$python" "$tool" --tokenizer "$dir/tok" --out "$dir/out.bin" --width "$width" \
    "$dir/a.txt" "$dir/b.jsonl" >"$dir/log" 2>&1 || fail "tokenize-hf failed: $(cat "$dir/log")"
  got=$("$python" -c "
import sys, array
a = array.array('H' if sys.argv[2] == 'u16' else 'I')
a.frombytes(open(sys.argv[1], 'rb').read())
if sys.byteorder != 'little': a.byteswap()
print(' '.join(map(str, a)))" "$dir/out.bin" "$width")
  [ "$got" = "$expected" ] || fail "$width ids: $got, expected $expected"
  grep -q "3 documents" "$dir/log" || fail "summary: $(cat "$dir/log")"
}
# a.txt: the cat sat on the mat </s>; b.jsonl: the mat sat </s>, a cat </s>
check u16 "2 3 4 5 2 6 1 2 6 4 1 7 3 1"
check u32 "2 3 4 5 2 6 1 2 6 4 1 7 3 1"

printf '{"body": "x"}\n' >"$dir/bad.jsonl"
rm -f "$dir/out2.bin"
err=$("$python" "$tool" --tokenizer "$dir/tok" --out "$dir/out2.bin" "$dir/bad.jsonl" 2>&1) &&
  fail "a record without the field was accepted"
grep -q 'bad.jsonl:1: no string field "text"' <<<"$err" || fail "unexpected message: $err"
[ ! -e "$dir/out2.bin" ] && [ ! -e "$dir/out2.bin.tmp" ] || fail "output left after an error"
err=$("$python" "$tool" --tokenizer "$dir/tok" --out "$dir/out2.bin" "$dir/none.txt" 2>&1) &&
  fail "a missing file was accepted"
grep -q "no file" <<<"$err" || fail "unexpected message: $err"
err=$("$python" "$tool" --tokenizer "$dir/tok" --out "$dir/out2.bin" --eos 70000 "$dir/a.txt" 2>&1) &&
  fail "an id beyond u16 was accepted"
grep -q "does not fit u16" <<<"$err" || fail "unexpected message: $err"
echo "tokenize-hf: all checks passed"
