#!/usr/bin/env python3
"""Tiny random Qwen3 checkpoints written by Hugging Face transformers, with reference logits.

    $D9D_HF_PYTHON tests/hf/make_fixtures.py        # (tools/setup writes D9D_HF_PYTHON)

Writes tests/hf/fixtures/<name>/{config.json, model.safetensors} with save_pretrained, and
reference.safetensors holding `input_ids` [2, 7] and the fp32 `logits` transformers computes for
them. The outputs are committed, so the C++ tests need no Python to load them.
"""
from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))

VARIANTS = {
    "qwen3_tiny_untied": False,
    "qwen3_tiny_tied": True,
}


def main() -> int:
    for name, tied in VARIANTS.items():
        torch.manual_seed(20261122)
        config = Qwen3Config(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
            attn_implementation="eager",
        )
        model = Qwen3ForCausalLM(config).float().eval()
        # Norm weights start at one; perturb them so a wrong norm shows in the logits.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
        out = os.path.join(HERE, "fixtures", name)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        os.remove(os.path.join(out, "generation_config.json"))  # not needed to load the model
        ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()},
                  os.path.join(out, "reference.safetensors"))
        print(f"{out}: logits {tuple(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
