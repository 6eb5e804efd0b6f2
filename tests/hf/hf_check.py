#!/usr/bin/env python3
"""Loads a d9d export with Hugging Face transformers and compares its logits with d9d's.

    python3-with-torch tests/hf/hf_check.py EXPORT_DIR REFERENCE.safetensors

REFERENCE holds `input_ids` and the fp32 `logits` d9d computed. Exit 0 when transformers'
logits match (atol 1e-5, rtol 1e-5), 1 otherwise; prints the largest difference and transformers'
count of the model's parameters (a tied head counted once).
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main() -> int:
    export_dir, reference = sys.argv[1], sys.argv[2]
    ref = load_file(reference)
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits.float()
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"transformers {type(model).__name__}: max |logits - d9d| = {diff:.3g}")
    print(f"transformers parameters: {model.num_parameters()}")
    return 0 if torch.allclose(logits, ref["logits"], atol=1e-5, rtol=1e-5) else 1


if __name__ == "__main__":
    sys.exit(main())
