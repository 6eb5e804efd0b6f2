// The libFuzzer target of the trainer's config loader, d9d::TrainerConfig::from_json_text
// (tools/fuzz/json_configs trainer builds and runs it with clang, ASan and UBSan;
// //tests/train:config_fuzz_replay_test replays the committed corpus through it with gcc).
//
//   LLVMFuzzerTestOneInput(bytes, size);   // returns 0, or aborts on a bug
//
// The rules it enforces: only d9d::ConfigError comes out of the loader, its message starting with
// "d9d config: "; an accepted config holds only values its documentation allows (sizes >= 1, a
// learning rate > 0, betas in [0, 1), a buildable LR schedule, ...); its "model" section, when
// present, goes through the Qwen3 reader, which may only throw std::invalid_argument; loading the
// same text twice gives the same config.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

#include <d9d/model/qwen3.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/train/config.hpp>

#include "tests/support/fuzz_target.hpp"

namespace {

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "trainer config fuzz: %s\n", what.c_str());
  std::abort();
}

void check(bool ok, const char* what) {
  if (!ok) {
    bug(std::string("an accepted config breaks a rule: ") + what);
  }
}

// The documented ranges of every value (docs/train.md, "Configuration").
void check_accepted(const d9d::TrainerConfig& c) {
  check(!c.run.output_dir.empty(), "run.output_dir is empty");
  check(c.run.total_steps >= 1, "run.total_steps < 1");
  check(c.run.log_every >= 1, "run.log_every < 1");
  check(!c.run.failure_timeout_s ||
            (*c.run.failure_timeout_s >= 1.0 && std::isfinite(*c.run.failure_timeout_s)),
        "run.failure_timeout_s out of range");
  check(c.batch.global_batch_size >= 1 && c.batch.microbatch_size >= 1 &&
            c.batch.sequence_length >= 1,
        "a batch size < 1");
  check(c.optimizer.lr > 0 && std::isfinite(c.optimizer.lr), "optimizer.lr not > 0");
  check(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1, "optimizer.beta1 not in [0, 1)");
  check(c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1, "optimizer.beta2 not in [0, 1)");
  check(c.optimizer.eps > 0 && std::isfinite(c.optimizer.eps), "optimizer.eps not > 0");
  check(c.optimizer.weight_decay >= 0 && std::isfinite(c.optimizer.weight_decay),
        "optimizer.weight_decay < 0");
  check(!c.gradient_clipping.max_norm ||
            (*c.gradient_clipping.max_norm > 0 && std::isfinite(*c.gradient_clipping.max_norm)),
        "gradient_clipping.max_norm not > 0");
  check(c.data_parallel.bucket_size_mb > 0, "data_parallel.bucket_size_mb not > 0");
  check(c.data_parallel.prefetch >= 0, "data_parallel.prefetch < 0");
  for (const auto& degree : {c.mesh.pp, c.mesh.dp_replicate, c.mesh.dp_shard, c.mesh.cp_replicate,
                             c.mesh.cp_shard, c.mesh.tp, c.mesh.ep}) {
    check(!degree || *degree >= 1, "a mesh degree < 1");
  }
  check(c.export_model.dtype == "float32" || c.export_model.dtype == "bfloat16",
        "export.dtype unknown");
  check(c.checkpoint.every >= 0 && c.checkpoint.keep >= 1, "checkpoint.every or keep out of range");
  check(!c.checkpoint.dir.empty(), "checkpoint.dir is empty");
  check(c.profile.start >= -1 && c.profile.steps >= 1, "profile out of range");
  check(c.numerics.on_nonfinite == "stop" || c.numerics.on_nonfinite == "skip",
        "numerics.on_nonfinite unknown");
  check(c.numerics.max_consecutive_skips >= 1 && c.numerics.loss_spike_window >= 1 &&
            c.numerics.loss_spike_factor > 1 && c.numerics.loss_spike_min_rise >= 0,
        "numerics out of range");
  try {
    (void)d9d::optim::PiecewiseSchedule::build(c.lr_schedule, c.run.total_steps);
  } catch (const std::exception& error) {
    bug(std::string("an accepted lr_schedule does not build: ") + error.what());
  }
}

// False when refused (the ConfigError checked); else the config is in `out`.
bool load(const std::string& text, d9d::TrainerConfig& out) {
  try {
    out = d9d::TrainerConfig::from_json_text(text);
    return true;
  } catch (const d9d::ConfigError& error) {
    if (std::string_view(error.what()).substr(0, 12) != "d9d config: ") {
      bug(std::string("a ConfigError without the \"d9d config: \" prefix: ") + error.what());
    }
    return false;
  } catch (const std::exception& error) {
    bug(std::string("not a ConfigError: ") + error.what());
  } catch (...) {
    bug("not a std::exception");
  }
}

}  // namespace

bool d9d::testing::fuzz_input_accepted(std::string_view input) {
  d9d::TrainerConfig config;
  return load(std::string(input), config);
}

// NOLINTNEXTLINE(readability-identifier-naming): the name libFuzzer calls
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  d9d::TrainerConfig config;
  if (!load(text, config)) {
    return 0;
  }
  check_accepted(config);
  d9d::TrainerConfig again;
  if (!load(text, again) || again.section("model") != config.section("model") ||
      again.run.total_steps != config.run.total_steps ||
      again.optimizer.lr != config.optimizer.lr) {
    bug("the same text loaded twice gives another config");
  }
  if (config.sections.count("model") != 0) {
    try {
      const auto model = d9d::model::Qwen3Config::from_json_text(config.section("model"));
      model.validate();
    } catch (const std::invalid_argument&) {
      // refused with the reader's error
    } catch (const std::exception& error) {
      bug(std::string("the model section: not std::invalid_argument: ") + error.what());
    }
  }
  return 0;
}
