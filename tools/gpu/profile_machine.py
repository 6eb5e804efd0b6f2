"""The machine profile of the Plan advisor (docs/advise.md, "Step time"): what this machine's GPUs
and links do, measured once and written as JSON for d9d::advise::MachineProfile.

Run by tools/gpu/profile-machine under torchrun (one process per GPU). Rank 0 measures, on its
GPU:
  gemm        bfloat16 matmuls (float32 accumulation) of every shape the dense Qwen3 configs
              given run per microbatch under tp 1, 2 and 4: a linear layer's forward
              (x[m,k] @ w[n,k]^T, layout "nt"), its input gradient (dy[m,n] @ w[n,k], "nn") and
              its weight gradient (dy[m,n]^T @ x[m,k], "tn"), at the configs' microbatch token
              counts, their halves (context parallelism) and doubles
  attention   causal scaled_dot_product_attention (the kernel LibTorch picks, grouped-query as
              the model calls it) forward and backward at the configs' head counts over tp
  grouped_experts  a MoE layer's routed experts (the Qwen3-MoE configs given) as d9d runs them:
              bfloat16 grouped GEMMs (torch._grouped_mm, balanced rows per expert) for gate and
              up, silu(gate) * up, the grouped down projection, forward and backward, for the
              local experts and rows of ep 1, 2 and 4 (rows = microbatch tokens x top-k)
  memory      the bandwidth a bfloat16 elementwise kernel reaches (y = x * a + b over 256 MiB:
              bytes read and written per second)
and all ranks the NCCL collectives over every GPU (all_reduce, all_gather, reduce_scatter,
all_to_all) and point-to-point (rank 0 to rank 1) from 64 KiB to 1 GiB: the median of the timed
repetitions, bytes counted as the tensor each rank passes (all_gather: its output, reduce_scatter:
its input, p2p: the message).
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F


def timed(fn, repeat=7, warmup=3, block_seconds=2e-3, inner=None):
    """Seconds of one call of fn: calls run back to back in blocks of at least block_seconds
    between two events (as a training step runs them, without the idle gaps that lower the
    clocks and the event overhead of timing one call), the median block over `repeat`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    if inner is None:  # collectives pass a fixed count: every rank must run as many
        inner = max(1, min(200, int(block_seconds / max(start.elapsed_time(end) / 1e3, 1e-7))))
    times = []
    for _ in range(repeat):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def gemm_shapes(configs, tps):
    shapes = set()
    for cfg in configs:
        m = cfg["model"]
        h, i, v = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
        q = m["num_attention_heads"] * m["head_dim"]
        kv = m["num_key_value_heads"] * m["head_dim"]
        tokens = cfg["batch"]["microbatch_size"] * cfg["batch"]["sequence_length"]
        for tp in tps:
            if q % tp or kv % tp or i % tp or v % tp:
                continue
            for t in (tokens // 2, tokens, 2 * tokens):
                # (out, in) of every linear layer a rank holds under tp (Megatron's layout)
                for n, k in ((q // tp, h), (kv // tp, h), (h, q // tp), (i // tp, h), (h, i // tp),
                             (v // tp, h)):
                    shapes.add((t, n, k, "nt"))
                    shapes.add((t, k, n, "nn"))
                    shapes.add((n, k, t, "tn"))
    return sorted(shapes)


def measure_gemm(shapes):
    out = []
    for m, n, k, layout in shapes:
        if layout == "nt":
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        elif layout == "nn":
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        else:  # "tn": a is stored [k, m]
            a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t()
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = timed(lambda: torch.mm(a, b))
        out.append({"m": m, "n": n, "k": k, "layout": layout, "seconds": seconds})
        del a, b
    return out


def measure_attention(configs, tps):
    out, seen = [], set()
    for cfg in configs:
        m = cfg["model"]
        batch = cfg["batch"]["microbatch_size"]
        seq = cfg["batch"]["sequence_length"]
        for tp in tps:
            heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
            if heads % tp or kv % tp:
                continue
            key = (batch, seq, heads // tp, kv // tp, m["head_dim"])
            if key in seen:
                continue
            seen.add(key)
            b, s, hq, hk, d = key
            q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            gqa = hq != hk
            fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=gqa))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            g = torch.randn_like(o)
            bwd = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
            out.append({"batch": b, "sequence": s, "heads": hq, "kv_heads": hk, "head_dim": d,
                        "forward_seconds": fwd, "backward_seconds": bwd})
    return out


def measure_grouped_experts(configs, eps):
    out, seen = [], set()
    for cfg in configs:
        m = cfg["model"]
        if m.get("model_type") != "qwen3_moe":
            continue
        tokens = cfg["batch"]["microbatch_size"] * cfg["batch"]["sequence_length"]
        for ep in eps:
            if m["num_experts"] % ep:
                continue
            key = (m["num_experts"] // ep, tokens * m["num_experts_per_tok"], m["hidden_size"],
                   m["moe_intermediate_size"])
            if key in seen:
                continue
            seen.add(key)
            groups, rows, h, i = key
            per = rows // groups
            offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * per
            rows = per * groups
            bf16 = dict(device="cuda", dtype=torch.bfloat16)
            x = torch.randn(rows, h, **bf16, requires_grad=True)
            gate = (torch.randn(groups, i, h, **bf16) * 0.02).requires_grad_()
            up = (torch.randn(groups, i, h, **bf16) * 0.02).requires_grad_()
            down = (torch.randn(groups, h, i, **bf16) * 0.02).requires_grad_()

            def forward():
                g = torch._grouped_mm(x, gate.transpose(-2, -1), offs=offsets)
                u = torch._grouped_mm(x, up.transpose(-2, -1), offs=offsets)
                return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offsets)

            fwd = timed(forward)
            y = forward()
            dy = torch.randn_like(y)
            bwd = timed(lambda: torch.autograd.grad(y, (x, gate, up, down), dy,
                                                    retain_graph=True))
            out.append({"groups": groups, "rows": rows, "hidden": h, "intermediate": i,
                        "forward_seconds": fwd, "backward_seconds": bwd})
            del x, gate, up, down, y, dy
    return out


def measure_memory():
    x = torch.randn(128 * 1024 * 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    seconds = timed(lambda: torch.mul(x, 0.5, out=y).add_(1.0))
    # mul reads x and writes y, add_ reads and writes y: four passes of 256 MiB
    return 4 * x.numel() * x.element_size() / seconds


def measure_collectives(rank, world):
    sizes = [(64 << 10) << (2 * j) for j in range(8)]  # 64 KiB, 256 KiB, ..., 1 GiB
    out = {"all_reduce": [], "all_gather": [], "reduce_scatter": [], "all_to_all": [], "p2p": []}
    for size in sizes:
        n = size // 2  # bfloat16 elements
        n -= n % world
        full = torch.ones(n, device="cuda", dtype=torch.bfloat16)
        part = torch.ones(n // world, device="cuda", dtype=torch.bfloat16)
        other = torch.empty_like(full)
        t = timed(lambda: dist.all_reduce(full), inner=5)
        out["all_reduce"].append([size, t])
        t = timed(lambda: dist.all_gather_into_tensor(full, part), inner=5)
        out["all_gather"].append([size, t])
        t = timed(lambda: dist.reduce_scatter_tensor(part, full), inner=5)
        out["reduce_scatter"].append([size, t])
        t = timed(lambda: dist.all_to_all_single(other, full), inner=5)
        out["all_to_all"].append([size, t])
        if world >= 2:
            def p2p():
                if rank == 0:
                    ops = [dist.P2POp(dist.isend, full, 1)]
                elif rank == 1:
                    ops = [dist.P2POp(dist.irecv, other, 0)]
                else:
                    return
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            t = timed(p2p, inner=5)
            out["p2p"].append([size, t])
        del full, part, other
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=["grouped_experts"],
                        help="measure this part alone on one GPU (merged into a profile by hand)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    configs = [json.load(open(path)) for path in args.config]
    profile = {"device": torch.cuda.get_device_name(), "ranks": world,
               "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    if args.only == "grouped_experts":
        profile["grouped_experts"] = measure_grouped_experts(configs, (1, 2, 4))
        with open(args.out, "w") as f:
            json.dump(profile, f, indent=1)
        print(json.dumps(profile["grouped_experts"], indent=1))
        return
    if rank == 0:
        tps = (1, 2, 4)
        profile["gemm"] = measure_gemm(gemm_shapes(configs, tps))
        profile["attention"] = measure_attention(configs, tps)
        profile["grouped_experts"] = measure_grouped_experts(configs, tps)
        profile["memory_bytes_per_second"] = measure_memory()
        torch.cuda.empty_cache()
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        dist.barrier()
        collectives = measure_collectives(rank, world)
        if rank == 0:
            profile["collectives"] = collectives
        dist.destroy_process_group()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(profile, f, indent=1)
        best = max(2 * g["m"] * g["n"] * g["k"] / g["seconds"] for g in profile["gemm"]) / 1e12
        print(f"{profile['device']}: {len(profile['gemm'])} matmuls (best {best:.0f} TFLOP/s), "
              f"memory {profile['memory_bytes_per_second'] / 1e12:.2f} TB/s -> {args.out}")
        for name, curve in profile.get("collectives", {}).items():
            size, t = curve[-1]
            print(f"  {name}: {size / t / 1e9:.1f} GB/s at {size >> 20} MiB, "
                  f"{curve[0][1] * 1e6:.1f} us at {curve[0][0] >> 10} KiB")


if __name__ == "__main__":
    main()
