#!/usr/bin/env python3
"""Hugging Face peft against d9d's LoRA adapters, both ways (run by //tests/peft:peft_hf_test).

    python3-with-torch tests/peft/peft_check.py load BASE_DIR ADAPTER_DIR REFERENCE.safetensors
        Loads the transformers model in BASE_DIR, puts the adapter d9d saved in ADAPTER_DIR on it
        with peft's PeftModel.from_pretrained, and compares its logits for REFERENCE's
        `input_ids` with REFERENCE's `logits` (d9d's). Exit 0 when they match (atol 1e-5,
        rtol 1e-5), 1 otherwise; prints peft's version, the wrapped model and the largest
        difference.

    python3-with-torch tests/peft/peft_check.py save BASE_DIR OUT_DIR
        Makes a LoRA adapter with peft on BASE_DIR's model (a regular-expression target_modules,
        a rank_pattern and an alpha_pattern, rsLoRA scaling, a module to save; random A and B),
        saves it to OUT_DIR with save_pretrained, and writes OUT_DIR/reference.safetensors with
        `input_ids` and peft's fp32 `logits` for d9d to compare with.
"""
import sys

import peft
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def base_model(base_dir):
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def load(base_dir, adapter_dir, reference):
    ref = load_file(reference)
    model = peft.PeftModel.from_pretrained(base_model(base_dir), adapter_dir).eval()
    adapted = [name for name, _ in model.named_modules() if name.endswith(".lora_A")]
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits.float()
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"peft {peft.__version__} {type(model).__name__} over {len(adapted)} adapted layers: "
          f"max |logits - d9d| = {diff:.3g}")
    return 0 if torch.allclose(logits, ref["logits"], atol=1e-5, rtol=1e-5) else 1


def save(base_dir, out_dir):
    torch.manual_seed(7)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*\.(q_proj|v_proj|down_proj)",
        rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 6}, use_rslora=True,
        modules_to_save=["model.norm"], init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base_model(base_dir), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name:
                parameter.mul_(1.5)  # the saved module differs from the base
    model.save_pretrained(out_dir)
    input_ids = torch.randint(model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model.eval()(input_ids=input_ids).logits.float()
    save_file({"input_ids": input_ids, "logits": logits.contiguous()}, f"{out_dir}/reference.safetensors")
    print(f"peft {peft.__version__}: saved an adapter to {out_dir}")
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "load":
        return load(*sys.argv[2:])
    if len(sys.argv) == 4 and sys.argv[1] == "save":
        return save(*sys.argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
