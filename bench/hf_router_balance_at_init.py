"""Router balance of a freshly initialised transformers Qwen3-MoE on the repository's docs as bytes.

    python3 bench/hf_router_balance_at_init.py README.md docs/*.md

Builds transformers' Qwen3MoeForCausalLM with its own initialisation at two shapes (the
Qwen3-30B-A3B layer: hidden 2048, 128 experts, top 8; and example 05's CPU shape: hidden 128, 8
experts, top 2), two layers each, runs 4 x 512 bytes of the files through it and prints each
layer's expert load max/mean (the bound is experts / top-k: every token on the same experts),
as example 05 reports it at step 0 (docs/moe.md).
"""
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main() -> None:
    torch.manual_seed(0)
    data = b"".join(open(path, "rb").read() for path in sys.argv[1:])
    ids = torch.tensor(list(data[: 4 * 512]), dtype=torch.long).view(4, 512)
    for hidden, experts, top, inter, heads, kv, head_dim in [(2048, 128, 8, 768, 32, 4, 128),
                                                             (128, 8, 2, 128, 4, 2, 32)]:
        config = Qwen3MoeConfig(vocab_size=258, hidden_size=hidden, intermediate_size=3 * hidden,
                                num_hidden_layers=2, num_attention_heads=heads,
                                num_key_value_heads=kv, head_dim=head_dim, num_experts=experts,
                                num_experts_per_tok=top, moe_intermediate_size=inter,
                                norm_topk_prob=True, output_router_logits=True,
                                decoder_sparse_step=1, mlp_only_layers=[])
        model = Qwen3MoeForCausalLM(config).eval()
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            chosen = logits.topk(top, dim=-1).indices.flatten()
            load = torch.bincount(chosen, minlength=experts).double()
            print(f"hidden {hidden}, {experts} experts, top {top}, layer {layer}: "
                  f"load max/mean {(load.max() / load.mean()).item():.3f} (bound {experts // top})")


if __name__ == "__main__":
    main()
