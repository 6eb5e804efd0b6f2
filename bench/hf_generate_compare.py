#!/usr/bin/env python3
"""Generation on one GPU: transformers' greedy tokens and speed next to tools/generate's.

    python3 bench/hf_generate_compare.py prepare DIR     # a random Qwen3-0.6B-shaped checkpoint + prompts
    python3 bench/hf_generate_compare.py reference DIR   # transformers: fp32 greedy tokens, bf16 timing

`prepare` writes DIR/model (save_pretrained, float32, seed 0) and DIR/prompts_{check,speed}.txt
(one prompt of space-separated ids per line: 4 x 32 tokens for the token check, 8 x 128 for the
speed). `reference` writes DIR/hf_check.txt (float32 greedy, 64 new tokens per check prompt, one
line per prompt) and prints transformers' bf16 greedy speed on the speed prompts (256 new tokens,
min_new_tokens = max_new_tokens, SDPA, its default dynamic cache) as a JSON line.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960)


def prompts(path: str) -> list[list[int]]:
    with open(path) as f:
        return [[int(x) for x in line.split()] for line in f if line.strip()]


def greedy(model, rows, new_tokens):
    ids = torch.tensor(rows, device="cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:].tolist()


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "prepare":
        torch.manual_seed(0)
        config = Qwen3Config(**SHAPE)
        model = Qwen3ForCausalLM(config).float()
        model.save_pretrained(os.path.join(root, "model"))
        g = torch.Generator().manual_seed(1)
        for name, (b, t) in {"check": (4, 32), "speed": (8, 128)}.items():
            rows = torch.randint(0, SHAPE["vocab_size"], (b, t), generator=g).tolist()
            with open(os.path.join(root, f"prompts_{name}.txt"), "w") as f:
                f.writelines(" ".join(map(str, r)) + "\n" for r in rows)
        return 0
    model = Qwen3ForCausalLM.from_pretrained(os.path.join(root, "model"), attn_implementation="sdpa",
                                             dtype=torch.float32).cuda().eval()
    check = greedy(model, prompts(os.path.join(root, "prompts_check.txt")), 64)
    with open(os.path.join(root, "hf_check.txt"), "w") as f:
        f.writelines(" ".join(map(str, r)) + "\n" for r in check)
    model = model.to(torch.bfloat16)
    rows = prompts(os.path.join(root, "prompts_speed.txt"))
    greedy(model, rows, 8)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    greedy(model, rows, 256)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"system": "transformers", "batch": len(rows), "prompt": len(rows[0]),
                      "new_tokens": 256, "seconds": round(seconds, 3),
                      "tokens_per_s": round(len(rows) * 256 / seconds, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
