#!/usr/bin/env python3
"""Tiny random Qwen3 checkpoints written by Hugging Face transformers, with reference logits.

    $D9D_HF_PYTHON tests/hf/make_fixtures.py      # transformers 4 (tools/setup writes D9D_HF_PYTHON)
    python-with-transformers-5 tests/hf/make_fixtures.py

Writes the fixtures of the running transformers' major version (4 or 5; the others are left as
they are): tests/hf/fixtures/<name>/ holds what save_pretrained writes (config.json and
model.safetensors, or model.safetensors.index.json and its shards) and reference.safetensors with
`input_ids` [2, 7] and the fp32 `logits` transformers computes for them. Also
tests/hf/fixtures/configs/transformers-<version>-full.json: a Qwen3 config with every key that
version's to_dict knows (use_diff=False), to check that d9d's reader knows them all. The outputs are
committed, so the C++ tests need no Python to load them.

A transformers 5 environment next to tools/setup's (pip install --no-deps transformers==5.x and
its pure-Python dependencies into a venv whose .pth file points at the LibTorch venv's
site-packages) is enough; nothing else of the repository depends on it.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
MAJOR = int(transformers.__version__.split(".")[0])

# name -> (transformers major version that writes it, tied LM head, rope theta, max shard size)
VARIANTS = {
    "qwen3_tiny_untied": (4, False, 10000.0, None),
    "qwen3_tiny_tied": (4, True, 10000.0, None),
    # transformers 5 writes the theta inside "rope_parameters"; not the default theta, so a reader
    # that misses it gives other logits.
    "qwen3_tiny_v5_untied_rope5e5": (5, False, 500000.0, None),
    # model-0000i-of-0000N.safetensors + model.safetensors.index.json.
    "qwen3_tiny_v5_tied_sharded": (5, True, 1000000.0, "20KB"),
}

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
)


def make_config(tied: bool, theta: float) -> Qwen3Config:
    if MAJOR >= 5:
        rope = dict(rope_parameters={"rope_type": "default", "rope_theta": theta})
    else:
        rope = dict(rope_theta=theta)
    return Qwen3Config(**SHAPE, **rope, tie_word_embeddings=tied, attn_implementation="eager")


def write_checkpoint(name: str, tied: bool, theta: float, max_shard_size: str | None) -> None:
    torch.manual_seed(20261122)
    config = make_config(tied, theta)
    model = Qwen3ForCausalLM(config).float().eval()
    # Norm weights start at one; perturb them so a wrong norm shows in the logits.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    out = os.path.join(HERE, "fixtures", name)
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):  # a rerun may shard differently
        os.remove(os.path.join(out, old))
    if max_shard_size is None:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    os.remove(os.path.join(out, "generation_config.json"))  # not needed to load the model
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()},
              os.path.join(out, "reference.safetensors"))
    # What the C++ tests rely on about the layout, checked where it is made.
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    if MAJOR >= 5:
        assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == theta, saved
    else:
        assert saved["rope_theta"] == theta, saved
    sharded = os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert sharded == (max_shard_size is not None), os.listdir(out)
    assert sharded != os.path.exists(os.path.join(out, "model.safetensors")), os.listdir(out)
    print(f"{out}: {sorted(os.listdir(out))}, logits {tuple(logits.shape)}")


def write_full_config() -> None:
    config = make_config(False, 10000.0)
    out = os.path.join(HERE, "fixtures", "configs")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"transformers-{transformers.__version__}-full.json")
    with open(path, "w") as f:
        f.write(config.to_json_string(use_diff=False))
    print(f"{path}")


def main() -> int:
    if MAJOR not in (4, 5):
        print(f"transformers {transformers.__version__}: only 4.x and 5.x fixtures exist")
        return 1
    for name, (major, tied, theta, max_shard_size) in VARIANTS.items():
        if major == MAJOR:
            write_checkpoint(name, tied, theta, max_shard_size)
    write_full_config()
    return 0


if __name__ == "__main__":
    sys.exit(main())
