#!/usr/bin/env python3
"""Tiny random Qwen3-MoE checkpoints written by Hugging Face transformers, with reference outputs.

    $D9D_HF_PYTHON tests/hf/make_moe_fixtures.py          # transformers 4 (4.57.1)
    python-with-transformers-5 tests/hf/make_moe_fixtures.py

Writes the fixtures of the running transformers' major version (the others are left as they are):
tests/hf/fixtures/<name>/ holds what save_pretrained writes (config.json and model.safetensors, or
model.safetensors.index.json and its shards; experts one by one, "mlp.experts.<e>.gate_proj.weight",
in both versions) and reference.safetensors with `input_ids` [2, 7], the fp32 `logits` and the
`aux_loss` (transformers' load_balancing_loss_func over every MoE layer, output_router_logits=True)
transformers computes for them. 4 experts, top 2, norm_topk_prob true and false, a dense layer
(mlp_only_layers or decoder_sparse_step); the routers are drawn wide (std 0.5) so tokens spread over
the experts and a wrong routing shows in the logits. Also
fixtures/configs/qwen3_moe-transformers-<version>-full.json (every key of to_dict(use_diff=False)).
make_fixtures.py's docstring says how to make
a throwaway transformers 5 environment.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
MAJOR = int(transformers.__version__.split(".")[0])

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    num_experts=4,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.01,
)

# name -> (major version, layers, norm_topk_prob, mlp_only_layers, decoder_sparse_step, tied,
#          rope theta, max shard size)
VARIANTS = {
    "qwen3_moe_tiny_norm": (4, 2, True, [1], 1, False, 10000.0, None),
    "qwen3_moe_tiny_nonorm_tied": (4, 3, False, [], 2, True, 10000.0, None),
    "qwen3_moe_tiny_v5_norm": (5, 2, True, [0], 1, False, 500000.0, None),
    "qwen3_moe_tiny_v5_nonorm_sharded": (5, 3, False, [2], 1, False, 1000000.0, "40KB"),
}


def make_config(layers, norm, mlp_only, step, tied, theta) -> Qwen3MoeConfig:
    if MAJOR >= 5:
        rope = dict(rope_parameters={"rope_type": "default", "rope_theta": theta})
    else:
        rope = dict(rope_theta=theta)
    return Qwen3MoeConfig(**SHAPE, **rope, num_hidden_layers=layers, norm_topk_prob=norm,
                          mlp_only_layers=mlp_only, decoder_sparse_step=step,
                          tie_word_embeddings=tied, attn_implementation="eager")


def write_checkpoint(name, layers, norm, mlp_only, step, tied, theta, max_shard_size) -> None:
    torch.manual_seed(20261125)
    config = make_config(layers, norm, mlp_only, step, tied, theta)
    model = Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))  # a wrong norm shows in the logits
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # routes spread over the experts
            else:
                p.normal_(0.0, 0.05)
    out = os.path.join(HERE, "fixtures", name)
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        os.remove(os.path.join(out, old))
    if max_shard_size is None:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    if os.path.exists(os.path.join(out, "generation_config.json")):
        os.remove(os.path.join(out, "generation_config.json"))
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        result = model(input_ids=ids, output_router_logits=True)
    save_file({"input_ids": ids.contiguous(), "logits": result.logits.float().contiguous(),
               "aux_loss": result.aux_loss.float().reshape(1).contiguous()},
              os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    experts_key = "num_local_experts" if MAJOR >= 5 else "num_experts"
    assert saved[experts_key] == 4, saved
    sharded = os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert sharded == (max_shard_size is not None), os.listdir(out)
    print(f"{out}: {sorted(os.listdir(out))}, aux {result.aux_loss.item():.6f}")


def write_full_config() -> None:
    """Every key this version's Qwen3MoeConfig.to_dict knows: d9d's reader must know them all."""
    config = make_config(2, True, [], 1, False, 10000.0)
    out = os.path.join(HERE, "fixtures", "configs")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"qwen3_moe-transformers-{transformers.__version__}-full.json")
    with open(path, "w") as f:
        f.write(config.to_json_string(use_diff=False))
    print(path)


def main() -> int:
    if MAJOR not in (4, 5):
        print(f"transformers {transformers.__version__}: only 4.x and 5.x fixtures exist")
        return 1
    for name, (major, *args) in VARIANTS.items():
        if major == MAJOR:
            write_checkpoint(name, *args)
    write_full_config()
    return 0


if __name__ == "__main__":
    sys.exit(main())
