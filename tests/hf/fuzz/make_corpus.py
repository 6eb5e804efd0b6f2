#!/usr/bin/env python3
"""Writes the seed corpus of the Hugging Face config fuzz target (tests/hf/fuzz/corpus).

valid_* seeds must be accepted by d9d::model::Qwen3Config::from_json_text and bad_* refused
(//tests/hf:qwen3_config_fuzz_replay_test checks both). The fixtures' config.json files, written by
transformers 4.57.1 and 5.17.0, are valid seeds. Run from the repository root:
    python3 tests/hf/fuzz/make_corpus.py
"""
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
FIXTURES = os.path.join(HERE, "..", "fixtures")

BASE = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def with_(**changes):
    out = dict(BASE)
    for key, value in changes.items():
        if value is ...:
            out.pop(key, None)
        else:
            out[key] = value
    return json.dumps(out)


def v5(**changes):
    out = dict(BASE)
    theta = out.pop("rope_theta")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    out.update(changes)
    return json.dumps(out)


SEEDS = {
    "valid_minimal.json": with_(),
    "valid_v5_rope_parameters.json": v5(),
    "valid_tied.json": with_(tie_word_embeddings=True, max_position_embeddings=128),
    "valid_nulls.json": with_(sliding_window=None, bos_token_id=None, rope_scaling=None),
    "bad_empty.json": "",
    "bad_empty_object.json": "{}",
    "bad_array.json": "[]",
    "bad_not_json.json": '{"vocab_size": ',
    "bad_missing_theta.json": with_(rope_theta=...),
    "bad_missing_hidden.json": with_(hidden_size=...),
    "bad_typo.json": with_(hidden_size=..., hiden_size=32),
    "bad_zero_size.json": with_(hidden_size=0),
    "bad_size_beyond_int.json": with_(vocab_size=2**31),
    "bad_size_overflow.json": with_(vocab_size=2**64),
    "bad_float_size.json": with_(num_hidden_layers=2.5),
    "bad_negative_eps.json": with_(rms_norm_eps=-1e-6),
    "bad_theta_overflow.json": with_().replace("10000.0", "1e999"),
    "bad_heads_not_dividing.json": with_(num_key_value_heads=3),
    "bad_odd_head_dim.json": with_(head_dim=7),
    "bad_model_type.json": with_(model_type="llama"),
    "bad_hidden_act.json": with_(hidden_act="gelu"),
    "bad_attention_bias.json": with_(attention_bias=True),
    "bad_sliding_window.json": with_(use_sliding_window=True, sliding_window=4096),
    "bad_layer_types.json": with_(layer_types=["full_attention", "sliding_attention"]),
    "bad_rope_yarn.json": with_(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    "bad_rope_v5_linear.json": v5(rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                   "factor": 2.0}),
    "bad_thetas_disagree.json": v5(rope_theta=5e5),
    "bad_quantization.json": with_(quantization_config={"quant_method": "gptq"}),
    "bad_auto_map.json": with_(auto_map={"AutoModel": "x.Y"}),
    "bad_key_twice.json": with_()[:-1] + ', "vocab_size": 65}',
    "bad_wrong_type.json": with_(tie_word_embeddings="yes"),
    "bad_deep.json": with_()[:-1] + ', "id2label": ' + "[" * 70 + "]" * 70 + "}",
    "bad_trailing.json": with_() + "]",
}


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    for name, text in SEEDS.items():
        with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
            f.write(text)
    for fixture in sorted(os.listdir(FIXTURES)):
        path = os.path.join(FIXTURES, fixture, "config.json")
        if os.path.exists(path):
            shutil.copy(path, os.path.join(OUT, "valid_fixture_" + fixture + ".json"))
    print(f"{len(os.listdir(OUT))} seeds in {OUT}")


if __name__ == "__main__":
    main()
