// d9d/train/compose.cpp — the compiled parts of d9d::compose and of what both loops read
// (d9d/train/compose.hpp).
#include <array>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <d9d/parallel/load.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/train/compose.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/format.hpp>

namespace d9d::detail {
namespace {

// The parameters of the LoRA adapters (lora_A and lora_B), by their names under `root`: a base
// checkpoint does not hold them, and they keep their initial values.
std::set<std::string> adapter_parameters(const torch::nn::Module& root) {
  std::set<std::string> out;
  for (const auto& lora : peft::lora_layers(root)) {
    out.insert(lora.a_name());
    out.insert(lora.b_name());
  }
  return out;
}

}  // namespace

parallel::ParallelizeOptions parallel_options(const TrainerConfig& config) {
  const auto& engine = config.data_parallel.reduce_engine;  // "auto": unset
  return {
      .bucket_bytes = static_cast<int64_t>(config.data_parallel.bucket_size_mb * 1024.0 * 1024.0),
      .reduce_engine = engine == "copy"      ? std::optional(parallel::ReduceEngine::copy)
                       : engine == "backend" ? std::optional(parallel::ReduceEngine::backend)
                                             : std::nullopt,
      .tied_embedding_rows = config.data_parallel.tied_embedding_rows,
      .reshard = config.data_parallel.reshard,
      .prefetch = static_cast<int>(config.data_parallel.prefetch),
      .reduce_every_microbatch = config.data_parallel.reduce_every_microbatch,
      .seed = config.run.seed};
}

int64_t microbatches_of(const TrainerConfig& config, const parallel::StepContributions& c,
                        const DeviceMesh& mesh) {
  return config.microbatches_per_step(c.samples(mesh).count);
}

void apply_failure_timeout(DistributedContext& context, const TrainerConfig& config) {
  if (config.run.failure_timeout_s) {
    context.set_failure_timeout(std::chrono::milliseconds(
        static_cast<int64_t>(std::llround(*config.run.failure_timeout_s * 1000.0))));
  }
}

void load_init_from(const DistributedContext& context, parallel::ParallelModel& parallel,
                    const std::string& from, const HfLoadMapper& mapper, const std::string& what,
                    bool stages_elsewhere) {
  state::StreamStats stats;
  try {
    const auto source = state::StateSource::open(from);
    std::vector<std::string> names;
    std::vector<std::string> adapters;
    std::set<std::string> seen;  // a parameter tied across this rank's stages is one name
    for (const auto& module : parallel.modules()) {
      const auto adapted = adapter_parameters(*module);
      for (const auto& item : module->named_parameters()) {
        if (seen.insert(item.key()).second) {
          (adapted.contains(item.key()) ? adapters : names).push_back(item.key());
        }
      }
    }
    stats = parallel::load_state(parallel, source,
                                 {.mapper = mapper ? mapper(source.keys(), names) : state::Mapper(),
                                  .ignore = {},
                                  .allow_unused_inputs = stages_elsewhere,
                                  .stages_elsewhere = stages_elsewhere,
                                  .keep = adapters});
  } catch (const std::exception& error) {
    throw ConfigError("d9d config: \"checkpoint.init_from\" = \"" + from + "\": " + error.what());
  }
  if (context.is_main_process()) {
    context.logger().info(
        what + " from " + from + ": " + std::to_string(stats.outputs) + " tensors, " +
        format::number(static_cast<double>(stats.output_bytes) / 1e6, "%.3g") + " MB on this rank");
  }
}

}  // namespace d9d::detail
