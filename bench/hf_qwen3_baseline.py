#!/usr/bin/env python3
"""The Python peers of examples/03_qwen3_quickstart: the same Qwen3 config and batch, trained with
Hugging Face transformers' Qwen3ForCausalLM and (on several GPUs) DistributedDataParallel. Prints
tokens/s, MFU (the example's FLOP count) and peak memory as one JSON line.

    python3 bench/hf_qwen3_baseline.py examples/03_qwen3_quickstart/qwen3_0p6b_gpu.json
    python3 bench/hf_qwen3_baseline.py CONFIG --mode liger --bf16-params --micro 8
    torchrun --nproc_per_node 2 bench/hf_qwen3_baseline.py examples/03_qwen3_quickstart/qwen3_0p6b_gpu.json

--mode: eager (default), compile (torch.compile of the model), liger (Liger kernels: RMSNorm,
RoPE, SwiGLU, fused linear cross-entropy; the liger-kernel package), liger-compile (both).
--bf16-params: bf16 parameters and torch.optim.AdamW(fused=True) (the peers' fastest setting);
without it fp32 parameters under bf16 autocast, what d9d::precision::Bf16Mixed does.
--lora R: Hugging Face peft LoRA (rank R, alpha 2R, no dropout) on every linear layer but the LM
head, the base frozen (the peft package; its default keeps the adapters in float32); the FLOP count
is then 4 per base parameter (no weight gradients), as the example's --lora line counts it.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM


def flops_per_token(m, seq, frozen_base=False):
    # Same formula as examples/03_qwen3_quickstart/main.cpp.
    h, inter, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    heads, kv, hd, vocab = m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"], m["vocab_size"]
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    non_embedding = layers * (attention + 3 * h * inter + 2 * h) + h
    return (4.0 if frozen_base else 6.0) * (non_embedding + vocab * h) + 12.0 * layers * heads * hd * seq


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--mode", choices=["eager", "compile", "liger", "liger-compile"],
                        default="eager")
    parser.add_argument("--bf16-params", action="store_true")
    parser.add_argument("--micro", type=int, default=0, help="microbatch size (default: config's)")
    parser.add_argument("--lora", type=int, default=0, help="peft LoRA rank (0: full training)")
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

    if args.mode.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        apply_liger_kernel_to_qwen3(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    config = Qwen3Config(**{k: v for k, v in m.items()}, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).cuda()
    if args.bf16_params:
        model = model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    if args.lora:
        from peft import LoraConfig, get_peft_model
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                                 lora_dropout=0.0, target_modules=targets))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local], bucket_cap_mb=cfg.get("data_parallel", {}).get("bucket_size_mb", 25))
    optimizer = torch.optim.AdamW(trainable, lr=o["lr"], betas=(o["beta1"], o["beta2"]),
                                  eps=o["eps"], weight_decay=o["weight_decay"],
                                  fused=args.bf16_params)
    forward = torch.compile(model) if args.mode.endswith("compile") else model
    seq, micro = b["sequence_length"], args.micro or b["microbatch_size"]
    accum = b["global_batch_size"] // (world * micro)
    generator = torch.Generator(device="cuda").manual_seed(rank)

    def step():
        for i in range(accum):
            tokens = torch.randint(0, 258, (micro, seq + 1), device="cuda", generator=generator)
            sync = (not distributed) or i == accum - 1
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16, enabled=not args.bf16_params):
                out = forward(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
                loss = out.loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item() * accum

    warmup = 3
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps - warmup):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_second = b["global_batch_size"] * seq * (args.steps - warmup) / seconds
    tflops = tokens_per_second * flops_per_token(m, seq, args.lora > 0) / 1e12 / world
    if rank == 0:
        impl = "transformers+" + args.mode + ("+bf16params" if args.bf16_params else "+autocast")
        impl += f"+peft-lora{args.lora}" if args.lora else ""
        print(json.dumps({"impl": impl, "params": params, "world": world, "micro": micro,
                          "trainable_params": sum(p.numel() for p in trainable),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                          "tokens_per_second": round(tokens_per_second),
                          "tflops_per_gpu": round(tflops, 1),
                          "mfu_percent": round(100 * tflops / args.peak_tflops, 1),
                          "step_seconds": round(seconds / (args.steps - warmup), 4),
                          "last_loss": round(loss, 4)}))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
