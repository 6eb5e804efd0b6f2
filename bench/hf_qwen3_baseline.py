#!/usr/bin/env python3
"""The plain-PyTorch baseline for examples/03_qwen3_quickstart: the same Qwen3 config and batch,
trained with Hugging Face transformers' Qwen3ForCausalLM, torch.optim.AdamW and (on several GPUs)
DistributedDataParallel, under bf16 autocast with fp32 parameters — what the C++ example does with
d9d::precision::Bf16Mixed. Prints tokens/s and MFU with the example's FLOP count.

    python3 bench/hf_qwen3_baseline.py examples/03_qwen3_quickstart/qwen3_0p6b_gpu.json
    torchrun --nproc_per_node 2 bench/hf_qwen3_baseline.py examples/03_qwen3_quickstart/qwen3_0p6b_gpu.json
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM


def flops_per_token(m, seq):
    # Same formula as examples/03_qwen3_quickstart/main.cpp.
    h, inter, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    heads, kv, hd, vocab = m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"], m["vocab_size"]
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    non_embedding = layers * (attention + 3 * h * inter + 2 * h) + h
    return 6.0 * (non_embedding + vocab * h) + 12.0 * layers * heads * hd * seq


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    cfg = json.load(open(args.config))
    m, b, o = cfg["model"], cfg["batch"], cfg["optimizer"]

    distributed = "RANK" in os.environ
    rank, world = 0, 1
    if distributed:
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    torch.manual_seed(1234)

    config = Qwen3Config(**{k: v for k, v in m.items()}, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).cuda()
    params = sum(p.numel() for p in model.parameters())
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local], bucket_cap_mb=cfg.get("data_parallel", {}).get("bucket_size_mb", 25))
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]),
                                  eps=o["eps"], weight_decay=o["weight_decay"])
    seq, micro = b["sequence_length"], b["microbatch_size"]
    accum = b["global_batch_size"] // (world * micro)
    generator = torch.Generator(device="cuda").manual_seed(rank)

    def step():
        for i in range(accum):
            tokens = torch.randint(0, 258, (micro, seq + 1), device="cuda", generator=generator)
            sync = (not distributed) or i == accum - 1
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
                loss = out.loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item() * accum

    warmup = 3
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps - warmup):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_second = b["global_batch_size"] * seq * (args.steps - warmup) / seconds
    tflops = tokens_per_second * flops_per_token(m, seq) / 1e12 / world
    if rank == 0:
        print(json.dumps({"impl": "transformers+torch", "params": params, "world": world,
                          "tokens_per_second": round(tokens_per_second),
                          "tflops_per_gpu": round(tflops, 1),
                          "mfu_percent": round(100 * tflops / args.peak_tflops, 1),
                          "step_seconds": round(seconds / (args.steps - warmup), 4),
                          "last_loss": round(loss, 4)}))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
