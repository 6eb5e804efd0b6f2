#!/usr/bin/env python3
"""Writes the seed corpus of the trainer config fuzz target (tests/train/fuzz/corpus).

valid_* seeds must be accepted by d9d::TrainerConfig::from_json_text and bad_* refused with a
ConfigError (//tests/train:config_fuzz_replay_test checks both). Run from the repository root:
    python3 tests/train/fuzz/make_corpus.py
"""
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))

RUN = '"run": {"output_dir": "out", "total_steps": 10}'
BATCH = '"batch": {"global_batch_size": 8, "microbatch_size": 2, "sequence_length": 16}'
MODEL = ('"model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, '
         '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
         '"head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}')


def config(*rest):
    return "{" + ", ".join((RUN, BATCH) + rest) + "}"


SEEDS = {
    "valid_minimal.json": config(),
    "valid_with_model.json": config(MODEL, '"data": {"paths": ["a.bin"], "token_width": "u16"}'),
    "valid_every_section.json": config(
        '"optimizer": {"lr": 0.001, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0}',
        '"lr_schedule": [{"steps": 2, "curve": "linear", "start": 0.1, "end": 1.0}, '
        '{"percent": 50, "curve": "polynomial", "start": 1.0, "end": 0.5, "power": 2}, '
        '{"rest": true, "curve": "cosine", "start": 0.5, "end": 0.0}]',
        '"gradient_clipping": {"max_norm": null}',
        '"data_parallel": {"bucket_size_mb": 0.5, "reshard": "never", "prefetch": 0, '
        '"reduce_every_microbatch": false}',
        '"mesh": {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}',
        '"logging": {"progress": false, "jsonl": true, "tensorboard": false}',
        '"export": {"enabled": false, "dtype": "bfloat16"}',
        '"checkpoint": {"every": 5, "keep": 3, "async": false, "resume": false, "dir": "c"}',
        '"profile": {"start": 1, "steps": 2, "dir": "p"}',
        '"numerics": {"on_nonfinite": "skip", "max_consecutive_skips": 3, '
        '"loss_spike_factor": 2.5, "loss_spike_window": 5}'),
    "valid_failure_timeout.json": config().replace('"total_steps": 10',
                                                   '"total_steps": 10, "failure_timeout_s": 30'),
    "bad_empty.json": "",
    "bad_not_json.json": "{run: 1",
    "bad_truncated.json": config()[:-20],
    "bad_array.json": "[1, 2, 3]",
    "bad_null.json": "null",
    "bad_empty_object.json": "{}",
    "bad_key_twice.json": config('"optimizer": {"lr": 0.1}', '"optimizer": {"lr": 0.2}'),
    "bad_key_twice_in_model.json": config('"model": {"rope_theta": 1e4, "rope_theta": 5e5}'),
    "bad_pp_overflow.json": config('"mesh": {"pp": 4294967297}'),
    "bad_steps_overflow.json": config().replace('"total_steps": 10',
                                                '"total_steps": 9223372036854775808'),
    "bad_number_overflow.json": config('"optimizer": {"lr": 1e999}'),
    "bad_negative_seed.json": config().replace('"total_steps": 10', '"total_steps": 10, "seed": -1'),
    "bad_float_steps.json": config().replace('"total_steps": 10', '"total_steps": 10.5'),
    "bad_zero_lr.json": config('"optimizer": {"lr": 0}'),
    "bad_beta_one.json": config('"optimizer": {"beta2": 1.0}'),
    "bad_unknown_key.json": config('"optimiser": {}'),
    "bad_misspelled_nested.json": config().replace('"microbatch_size"', '"micro_batch_size"'),
    "bad_wrong_type.json": config('"logging": {"progress": "yes"}'),
    "bad_section_not_object.json": config('"model": [1]'),
    "bad_phase_two_lengths.json": config('"lr_schedule": [{"steps": 2, "rest": true}]'),
    "bad_phase_too_long.json": config('"lr_schedule": [{"steps": 11}]'),
    "bad_curve.json": config('"lr_schedule": [{"steps": 2, "curve": "cosin"}]'),
    "bad_numerics.json": config('"numerics": {"on_nonfinite": "ignore"}'),
    "bad_spike_factor.json": config('"numerics": {"loss_spike_factor": 1}'),
    "bad_failure_timeout.json": config().replace('"total_steps": 10',
                                                 '"total_steps": 10, "failure_timeout_s": 0.5'),
    "bad_deep.json": config('"data": {"x": ' + "[" * 70 + "]" * 70 + "}"),
    "valid_deep_data.json": config('"data": {"x": ' + "[" * 40 + "]" * 40 + "}"),
    "bad_utf8.json": config().replace('"out"', '"o\xff\xfe"'),
    "bad_trailing.json": config() + " {}",
    "bad_nan.json": config('"optimizer": {"lr": NaN}'),
    "bad_missing_batch.json": "{" + RUN + "}",
}


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    for name, text in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(text.encode("latin-1") if "\xff" in text else text.encode("utf-8"))
    # The example configs of the repository are valid too.
    examples = os.path.join(ROOT, "examples", "03_qwen3_quickstart")
    for name in sorted(os.listdir(examples)):
        if name.endswith(".json"):
            shutil.copy(os.path.join(examples, name), os.path.join(OUT, "valid_example_" + name))
    print(f"{len(os.listdir(OUT))} seeds in {OUT}")


if __name__ == "__main__":
    main()
