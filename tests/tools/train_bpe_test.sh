#!/usr/bin/env bash
# tools/train-bpe: a byte-level BPE tokenizer learned from local text loads with AutoTokenizer,
# has the asked vocabulary, encodes unseen UTF-8 text and decodes it back exactly, compresses its
# training text, is the same when trained twice, and feeds tools/tokenize-hf; bad arguments are
# named and leave no output. Needs D9D_HF_PYTHON (tools/test passes it).
set -uo pipefail
train=$1
tokenize=$2
python=${D9D_HF_PYTHON:?"D9D_HF_PYTHON is not set (tools/test passes it; tools/setup writes it)"}
dir=${TEST_TMPDIR:-$(mktemp -d)}/train_bpe
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "FAIL: $*" >&2; exit 1; }

# A small corpus with repeated words (so merges exist) and a few non-ASCII characters.
"$python" - "$dir" <<'PY'
import random, sys
random.seed(7)
words = ["the", "tensor", "parallel", "pipeline", "gradient", "shard", "rank", "café", "step"]
for name in ("a.txt", "b.txt"):
    with open(f"{sys.argv[1]}/{name}", "w", encoding="utf-8") as f:
        for _ in range(400):
            f.write(" ".join(random.choice(words) for _ in range(12)) + ".\n")
PY

"$python" "$train" --out "$dir/tok" --vocab-size 300 "$dir/a.txt" "$dir/b.txt" >"$dir/log" 2>&1 ||
  fail "train-bpe failed: $(cat "$dir/log")"
grep -q "300 ids" "$dir/log" || fail "summary: $(cat "$dir/log")"
[ ! -e "$dir/tok.tmp" ] || fail "the temporary directory was left behind"
"$python" - "$dir" <<'PY' || fail "the trained tokenizer does not behave"
import sys
from transformers import AutoTokenizer
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d + "/tok", local_files_only=True)
assert len(tok) == 300, len(tok)
assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None, tok.eos_token_id
unseen = "naïve pipeline — 日本語 ✓\n\ttabs and\r\nnewlines 123"
ids = tok.encode(unseen, add_special_tokens=False)
assert all(0 <= i < 300 for i in ids), ids
assert tok.decode(ids) == unseen, tok.decode(ids)
text = open(d + "/a.txt", encoding="utf-8").read()
n = len(tok.encode(text, add_special_tokens=False))
assert n * 2 < len(text.encode("utf-8")), (n, len(text))  # merges learned: > 2 bytes per token
PY
"$python" "$train" --out "$dir/tok2" --vocab-size 300 "$dir/a.txt" "$dir/b.txt" >/dev/null 2>&1 ||
  fail "second training failed"
cmp -s "$dir/tok/tokenizer.json" "$dir/tok2/tokenizer.json" || fail "training twice differs"

"$python" "$tokenize" --tokenizer "$dir/tok" --out "$dir/corpus.bin" "$dir/a.txt" >"$dir/log" 2>&1 ||
  fail "tokenize-hf with the trained tokenizer failed: $(cat "$dir/log")"
"$python" - "$dir" <<'PY' || fail "the token file does not match the tokenizer"
import array, sys
from transformers import AutoTokenizer
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d + "/tok", local_files_only=True)
a = array.array("H")
a.frombytes(open(d + "/corpus.bin", "rb").read())
if sys.byteorder != "little":
    a.byteswap()
want = tok.encode(open(d + "/a.txt", encoding="utf-8").read(), add_special_tokens=False)
assert list(a) == want + [tok.eos_token_id], (len(a), len(want))
PY

expect_error() {  # message, args...
  local message=$1
  shift
  rm -rf "$dir/bad" "$dir/bad.tmp"
  err=$("$python" "$train" --out "$dir/bad" "$@" 2>&1) && fail "accepted: $*"
  grep -qF "$message" <<<"$err" || fail "unexpected message for $*: $err"
  [ ! -e "$dir/bad" ] && [ ! -e "$dir/bad.tmp" ] || fail "output left after: $*"
}
expect_error "needs at least 258" --vocab-size 100 "$dir/a.txt"
expect_error "no file" "$dir/none.txt"
printf '\xff\xfe bad' >"$dir/latin.txt"
expect_error "is not UTF-8" "$dir/latin.txt"
err=$("$python" "$train" --out "$dir/tok" "$dir/a.txt" 2>&1) && fail "an existing --out was replaced"
grep -qF "give --force" <<<"$err" || fail "unexpected message: $err"
echo "train-bpe: all checks passed"
