"""Router balance of a freshly initialised transformers Qwen3-MoE on the repository's docs as bytes.

    python3 bench/hf_router_balance_at_init.py README.md docs/*.md

Builds transformers' Qwen3MoeForCausalLM with its own initialisation at two shapes (the
Qwen3-30B-A3B layer: hidden 2048, 128 experts, top 8; and example 05's CPU shape: hidden 128, 8
experts, top 2), two layers each, runs 4 x 512 bytes of the files through it and prints each
layer's expert load max/mean (the bound is experts / top-k: every token on the same experts),
as example 05 reports it at step 0 (docs/moe.md), and why: the mean cosine between each token's
router input and the tokens' mean direction (1: every token gives the router the same input).
Each shape runs twice: with transformers' embeddings (normal, std initializer_range = 0.02) and
with embeddings of std 1, which the first layer's attention output no longer drowns.
"""
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def measure(config: Qwen3MoeConfig, ids: torch.Tensor, embedding_std: float | None) -> None:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    if embedding_std is not None:
        torch.nn.init.normal_(model.model.embed_tokens.weight, 0.0, embedding_std)
    inputs = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _module, args, _out: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
        for layer in model.model.layers]
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    for hook in hooks:
        hook.remove()
    top, experts = config.num_experts_per_tok, config.num_experts
    label = "transformers' init" if embedding_std is None else f"embeddings std {embedding_std}"
    for layer, logits in enumerate(out.router_logits):
        chosen = logits.topk(top, dim=-1).indices.flatten()
        load = torch.bincount(chosen, minlength=experts).double()
        unit = torch.nn.functional.normalize(inputs[layer].double(), dim=-1)
        mean_direction = torch.nn.functional.normalize(unit.mean(0), dim=0)
        cosine = (unit @ mean_direction).mean().item()
        print(f"hidden {config.hidden_size}, {experts} experts, top {top}, {label}, layer {layer}: "
              f"load max/mean {(load.max() / load.mean()).item():.3f} (bound {experts // top}), "
              f"router inputs' cosine to their mean {cosine:.3f}")


def main() -> None:
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
        for embedding_std in (None, 1.0):
            measure(config, ids, embedding_std)


if __name__ == "__main__":
    main()
