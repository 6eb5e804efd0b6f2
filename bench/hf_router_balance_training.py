"""Router balance of transformers' own Qwen3-MoE while it trains on the repository's docs as bytes.

    python3 bench/hf_router_balance_training.py transformers README.md docs/*.md docs/design/*.md
    python3 bench/hf_router_balance_training.py 1.0 README.md docs/*.md docs/design/*.md

A reference for d9d's routers (docs/moe.md, "Measured"): transformers' Qwen3MoeForCausalLM (4
layers, hidden 256, 32 experts, top 4) with its auxiliary loss at 0.01, AdamW at 1e-3, 120 steps
of 8 random 256-byte windows, on the CPU. The first argument is the embeddings' initial std
("transformers": its own, initializer_range = 0.02). Prints each layer's expert load max/mean
(bound 8) every 20 steps.
"""
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main() -> None:
    embedding_std = None if sys.argv[1] == "transformers" else float(sys.argv[1])
    data = torch.tensor(list(b"".join(open(path, "rb").read() for path in sys.argv[2:])))
    experts, top, window, rows = 32, 4, 256, 8
    config = Qwen3MoeConfig(vocab_size=258, hidden_size=256, intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_experts=experts, num_experts_per_tok=top,
                            moe_intermediate_size=128, norm_topk_prob=True,
                            output_router_logits=True, decoder_sparse_step=1, mlp_only_layers=[],
                            router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    if embedding_std is not None:
        torch.nn.init.normal_(model.model.embed_tokens.weight, 0.0, embedding_std)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(120):
        starts = torch.randint(0, len(data) - window - 1, (rows,), generator=generator)
        ids = torch.stack([data[s:s + window] for s in starts])
        out = model(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == 119:
            ratios = []
            for logits in out.router_logits:
                load = torch.bincount(logits.topk(top, -1).indices.flatten(), minlength=experts)
                ratios.append((load.max() / load.double().mean()).item())
            print(f"embeddings {sys.argv[1]}, step {step}: loss {out.loss.item():.3f}, load "
                  f"max/mean {sum(ratios) / len(ratios):.2f} (layers "
                  f"{' '.join(f'{r:.2f}' for r in ratios)}; bound {experts // top})", flush=True)


if __name__ == "__main__":
    main()
