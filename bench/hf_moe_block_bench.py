#!/usr/bin/env python3
"""transformers' Qwen3MoeSparseMoeBlock forward + backward on one GPU, the shape of
bench/moe_layer_bench.cpp (Qwen3-30B-A3B's layer: hidden 2048, 128 experts, top 8, expert size
768; 8192 tokens; bf16), with each experts implementation transformers offers ("eager": a loop
over the hit experts; transformers 5 also "batched_mm" and "grouped_mm").

    python3 bench/hf_moe_block_bench.py [--tokens 8192] [--iters 20]
"""
import argparse
import time

import torch
import transformers
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    major = int(transformers.__version__.split(".")[0])
    impls = ["eager", "batched_mm", "grouped_mm"] if major >= 5 else ["eager"]
    for impl in impls:
        config = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=768, norm_topk_prob=True)
        if major >= 5:
            config._experts_implementation = impl
        torch.manual_seed(0)
        block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        x = torch.randn(1, args.tokens, 2048, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)

        def step():
            block.zero_grad(set_to_none=True)
            x.grad = None
            out = block(x)
            y = out[0] if isinstance(out, tuple) else out
            y.float().square().mean().backward()
            return x.grad.float().abs().sum().item()

        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                check = step()
            seconds = (time.perf_counter() - start) / args.iters
        except Exception as error:  # an implementation this build lacks
            print(f"transformers {transformers.__version__} {impl:11s} failed: {error}")
            continue
        flops = 3.0 * args.tokens * (2 * 8 * 3 * 2048 * 768 + 2 * 2048 * 128)
        print(f"transformers {transformers.__version__} {impl:11s} forward+backward "
              f"{seconds * 1e3:8.2f} ms  {flops / seconds / 1e12:8.1f} TFLOP/s  (|dx| sum {check:.4g})")


if __name__ == "__main__":
    main()
