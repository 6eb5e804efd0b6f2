// examples/07_compare_plans — the quickstart's Qwen3 trained under several Plans in one binary and
// measured side by side (d9d::bench::compare, d9d/advise/compare.hpp).
//
//   07_compare_plans quickstart.json --data corpus.bin --output runs/compare --steps 6
//   tools/d9drun -n 2 07_compare_plans quickstart.json --data corpus.bin --bf16 --peak-tflops 989
//
// prints one row per Plan: tokens/s, the ratio to the first Plan, MFU (with --peak-tflops), the
// device memory the most loaded rank allocated, and the parameter, gradient and AdamW bytes it
// holds next to the advisor's prediction; --json writes the rows. The Plans below are the ones
// compared; each is a type, so a variant is one `using` line and one name.
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>

#include <d9d/advise/compare.hpp>
#include <d9d/d9d.hpp>

#include "examples/common/command_line.hpp"
#include "examples/common/report.hpp"

// ---- the Plans compared
// --------------------------------------------------------------------------
using ReplicateMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;
using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
template <class Precision>
using Replicated = d9d::Plan<ReplicateMesh, d9d::parallel::Replicate, Precision>;
template <class Precision>
using Sharded = d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Precision>;
template <class Precision>
using ShardedRecomputed =
    d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Precision, d9d::recompute::Full>;
// -------------------------------------------------------------------------------------------------

namespace {

struct Options {
  std::string config_path;
  std::string data;
  std::string output;
  int64_t steps = 0;
  int64_t warmup = 1;
  bool bf16 = false;
  double peak_tflops = 0;
  std::string json;
  std::string profile;
};

template <class Precision>
int compare(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& cfg, const Options& o) {
  const auto model = d9d::model::Qwen3Config::from_json_text(cfg.section("model"));
  d9d::bench::CompareOptions options;
  options.names = {"replicate", "fsdp", "fsdp-recompute"};
  options.warmup_steps = o.warmup;
  options.flops_per_token = report::training_flops_per_token(
      model, model.non_embedding_parameter_count(), cfg.batch.sequence_length);
  options.peak_tflops = o.peak_tflops;
  options.json_path = o.json;
  std::optional<d9d::advise::MachineProfile> machine;
  if (!o.profile.empty()) {
    machine = d9d::advise::MachineProfile::from_file(o.profile);
    options.machine = &*machine;
  }
  (void)
      d9d::bench::compare<Replicated<Precision>, Sharded<Precision>, ShardedRecomputed<Precision>>(
          ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{}, d9d::CausalLmTask{}, cfg, options);
  return 0;
}

int run(const Options& o) {
  const auto ctx = d9d::DistributedContext::from_env();
  auto overrides = command_line::run_overrides(o.data, o.output, o.steps);
  command_line::measuring(overrides);
  const auto cfg = d9d::TrainerConfig::from_file(o.config_path, overrides);
  return o.bf16 ? compare<d9d::precision::Bf16Mixed>(ctx, cfg, o)
                : compare<d9d::precision::Fp32>(ctx, cfg, o);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train the quickstart's Qwen3 under several Plans and compare them"};
  Options o;
  app.add_option("config", o.config_path, "trainer configuration (JSON), e.g. quickstart.json")
      ->required();
  app.add_option("--data", o.data, "token file, replacing data.paths");
  app.add_option("--output", o.output, "output directory (one folder per Plan inside)");
  app.add_option("--steps", o.steps, "optimizer steps per Plan, replacing run.total_steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "steps per Plan left out of the throughput (default 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--bf16", o.bf16, "bf16 mixed precision for every Plan (d9d::precision::Bf16Mixed)");
  app.add_option("--peak-tflops", o.peak_tflops,
                 "one device's peak TFLOP/s for the MFU column (e.g. 989 for H100/H200 bf16)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--json", o.json, "write the rows as JSON here (main rank)");
  app.add_option("--profile", o.profile,
                 "machine profile (tools/gpu/profile-machine): the predicted tokens/s column");
  CLI11_PARSE(app, argc, argv);
  return d9d::run_main(argc, argv, [&o] { return run(o); });
}
