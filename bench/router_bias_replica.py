#!/usr/bin/env python3
"""The auxiliary-loss-free bias on a collapsed router, in PyTorch: the bias on the probabilities
(d9d before design 0009's "Balancing" section, and Megatron's softmax routers) against the bias on
the logits (d9d now), with DeepSeek-V3's sign rule and the proportional rule. 64 experts, top 8,
inputs whose mean points at experts 0-7, 4,096 fresh tokens per step from the same distribution.
Prints max/mean load at some steps and the least and largest over the last 50.

    python3 bench/router_bias_replica.py          # any Python with torch (CPU, ~1 minute)

tests/model/moe_test.cpp (Model_Moe_BiasBalancing) checks the logit-space rules on a router of the
same shape with d9d's MoeRouter.
"""
import torch

E, K, H, N = 64, 8, 32, 4096


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(E, H) * 0.02
    mean = torch.randn(H)
    mean = mean / mean.norm() * 3
    weight[:K] += mean * 0.5

    def run(rate: float, space: str, rule: str, steps: int = 300) -> list:
        bias = torch.zeros(E)
        ratios = []
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            logits = (mean + torch.randn(N, H, generator=generator)) @ weight.T
            scores = torch.softmax(logits, -1) if space == "probabilities" else logits
            chosen = torch.topk(scores + bias, K, -1).indices
            load = torch.bincount(chosen.reshape(-1), minlength=E).double()
            ratios.append((load.max() / load.mean()).item())
            error = (load.mean() - load) / load.mean()
            bias += rate * (torch.sign(error) if rule == "sign" else error).float()
        return ratios

    for space, rule, rates in [("probabilities", "sign", [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]),
                               ("logits", "sign", [3e-3, 1e-2, 3e-2, 1e-1]),
                               ("logits", "proportional", [3e-3, 1e-2, 3e-2, 1e-1])]:
        for rate in rates:
            r = run(rate, space, rule)
            steps = " ".join(f"{r[i]:.2f}" for i in [0, 25, 50, 100, 150, 200, 250, 299])
            print(f"bias on {space:<13} {rule:<12} rate {rate:<6g}: {steps}   last 50: "
                  f"{min(r[-50:]):.2f}..{max(r[-50:]):.2f}")


if __name__ == "__main__":
    main()
