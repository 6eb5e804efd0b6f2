#!/usr/bin/env python3
"""Greedy continuations by Hugging Face transformers of the committed tiny Qwen3 fixtures.

    $D9D_HF_PYTHON tests/hf/make_generation_fixture.py   # tools/setup writes D9D_HF_PYTHON

For qwen3_tiny_untied and qwen3_tiny_tied (written by make_fixtures.py) writes
tests/hf/fixtures/<name>/generation.safetensors: `prompts` [3, 7] int64, left-padded with -1 (the
prompts have 7, 3 and 5 tokens), and `greedy` [3, 16] int64, transformers' greedy continuation of
each prompt (model.generate in float64 with SDPA attention (its eager attention gives NaN for left padding in
float64), do_sample=False, the batch left-padded with an attention
mask, no stop token), and `margin` [3, 16] float64: the gap between the chosen token's logit and
the runner-up's at every step. The script fails unless every margin is at least 1e-6, so a reader
that computes the same logits to float64 rounding must choose the same tokens, and unless each
prompt alone gives the same tokens as in the batch.
"""
from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[5, 17, 42, 8, 91, 3, 60], [77, 2, 33], [11, 12, 13, 14, 15]]
NEW_TOKENS = 16
MIN_MARGIN = 1e-6


def greedy(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                             pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[:, longest:]
    logits = torch.stack(out.logits, dim=1)  # [B, new, vocab]
    top2 = logits.topk(2, dim=-1).values
    return tokens, top2[..., 0] - top2[..., 1]


def main() -> int:
    for name in ("qwen3_tiny_untied", "qwen3_tiny_tied"):
        path = os.path.join(HERE, "fixtures", name)
        model = Qwen3ForCausalLM.from_pretrained(path, attn_implementation="sdpa").double().eval()
        tokens, margin = greedy(model, PROMPTS)
        for row, prompt in enumerate(PROMPTS):
            alone, _ = greedy(model, [prompt])
            assert torch.equal(alone[0], tokens[row]), (name, row, alone, tokens[row])
        smallest = margin.min().item()
        assert smallest >= MIN_MARGIN, f"{name}: a greedy step has a logit margin of {smallest}"
        longest = max(len(p) for p in PROMPTS)
        prompts = torch.full((len(PROMPTS), longest), -1, dtype=torch.long)
        for row, prompt in enumerate(PROMPTS):
            prompts[row, :len(prompt)] = torch.tensor(prompt)
        save_file({"prompts": prompts, "greedy": tokens.contiguous(),
                   "margin": margin.contiguous()},
                  os.path.join(path, "generation.safetensors"))
        print(f"{path}/generation.safetensors: smallest margin {smallest:.3g}")
        print(tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
