#!/usr/bin/env bash
# Runs the example on a base checkpoint into the test's scratch directory; its exit status is the
# verdict (the example checks its own result).
set -euo pipefail
exec "$1" --base "$2" --output "${TEST_TMPDIR:-/tmp}/04_lora_finetune" --steps 30
