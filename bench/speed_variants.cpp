// bench/speed_variants.cpp — the quickstart's Qwen3 under the Plan variants of
// tools/gpu/speed-bench, trained one after the other in one process and measured side by side by
// d9d::bench::compare (d9d/advise/compare.hpp); the GPU tool runs it next to the Python peers.
//
//   speed_variants qwen3_0p6b_gpu.json --data corpus.bin --output runs/variants --steps 30
//       --warmup 3 --peak-tflops 989 --variants bf16_sr,lora_sr --json rows.json
//       --profile docs/profiles/h200-1gpu.json   (one line)
//
// prints compare's table (tokens/s, the ratio to the first variant run, MFU, peak memory, the
// state held next to the advisor's prediction; with --profile the predicted tokens/s too) and
// writes its rows as JSON. A variant is a Plan
// (a type in `Variants`) with two settings compare's `configure` applies before its trainer is
// built: d9d's fused kernels on or off, and CUDA graphs. The warm-up covers CUDA graphs' eager
// step and capture (3 by default). LoRA's MFU counts the frozen base's FLOPs (no weight
// gradients: 4 per parameter instead of 6), which compare's one FLOPs-per-token figure does not
// know, so this tool sets that row's MFU itself.
#include <array>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include <d9d/advise/compare.hpp>
#include <d9d/d9d.hpp>
#include <d9d/peft/lora.hpp>

#include "examples/common/command_line.hpp"
#include "examples/common/report.hpp"

namespace {

namespace precision = d9d::precision;

template <class... Slots>
using Replicated =
    d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::parallel::Replicate, Slots...>;
template <class... Slots>
using Sharded =
    d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>, Slots...>;
using Bf16 = precision::Bf16Mixed;
using Sr = precision::Bf16Params<>;  // bfloat16 parameters, AdamW rounding stochastically
using SrBf16Moments =
    precision::Bf16Params<precision::StochasticRounding, precision::Dtype::bfloat16>;
using Nearest = precision::Bf16Params<precision::NearestRounding>;
using Lora = d9d::peft::Lora<16, 32>;  // rank 16 on every linear layer but the head

struct Variant {
  std::string_view name;
  bool fused_kernels = true;
  bool cuda_graphs = false;
  bool frozen_base = false;  // a PEFT Plan: the base's weights get no gradients
};

// ---- the variants, one row of kVariants per type of Variants, in the same order ----------------
template <class... Plans>
struct PlanList {
  static constexpr std::size_t size = sizeof...(Plans);
};
using Variants =
    PlanList<Replicated<Bf16>, Replicated<Bf16>, Replicated<Sr>, Replicated<Nearest>,
             Replicated<SrBf16Moments>, Sharded<Bf16>, Sharded<Sr>,
             Sharded<Bf16, d9d::recompute::Full>, Replicated<Lora, Sr>, Replicated<Lora, Bf16>,
             Replicated<Bf16>, Replicated<Sr>, Replicated<SrBf16Moments>>;
constexpr std::array kVariants{
    Variant{.name = "bf16_mixed"},
    Variant{.name = "bf16_mixed_unfused", .fused_kernels = false},
    Variant{.name = "bf16_sr"},
    Variant{.name = "bf16_nearest"},
    Variant{.name = "bf16_sr_bf16_moments"},
    Variant{.name = "fsdp_bf16_mixed"},
    Variant{.name = "fsdp_bf16_sr"},
    Variant{.name = "fsdp_bf16_mixed_recompute"},
    Variant{.name = "lora_sr", .frozen_base = true},
    Variant{.name = "lora_bf16_mixed", .frozen_base = true},
    Variant{.name = "bf16_mixed_graphs", .cuda_graphs = true},
    Variant{.name = "bf16_sr_graphs", .cuda_graphs = true},
    Variant{.name = "bf16_sr_bf16_moments_graphs", .cuda_graphs = true},
};
static_assert(Variants::size == kVariants.size(), "one Variant row per Plan of Variants");
// -------------------------------------------------------------------------------------------------

struct Options {
  std::string config_path;
  std::string data;
  std::string output;
  int64_t steps = 0;
  int64_t warmup = 3;
  double peak_tflops = 0;
  std::vector<std::string> variants;
  std::string json;
  std::string profile;
};

template <class... Plans>
d9d::bench::Comparison compare_variants(PlanList<Plans...> /*variants*/,
                                        const d9d::DistributedContext& ctx,
                                        const d9d::TrainerConfig& cfg,
                                        const d9d::bench::CompareOptions& options) {
  return d9d::bench::compare<Plans...>(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
                                       d9d::CausalLmTask{}, cfg, options);
}

const Variant& variant_named(const std::string& name) {
  for (const auto& v : kVariants) {
    if (v.name == name) {
      return v;
    }
  }
  throw std::invalid_argument("speed_variants: no variant " + name);
}

void write_json(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text << "\n";
  if (!out) {
    throw std::runtime_error("speed_variants: cannot write " + path +
                             ". Fix: pass a path on a writable file system");
  }
}

int run(const Options& o) {
  const auto ctx = d9d::DistributedContext::from_env();
  auto overrides = command_line::run_overrides(o.data, o.output, o.steps);
  command_line::measuring(overrides);
  const auto cfg = d9d::TrainerConfig::from_file(o.config_path, overrides);
  const auto model = d9d::model::Qwen3Config::from_json_text(cfg.section("model"));
  const auto flops = [&](bool frozen_base) {
    return report::training_flops_per_token(model, model.non_embedding_parameter_count(),
                                            cfg.batch.sequence_length, frozen_base);
  };

  d9d::bench::CompareOptions options;
  options.names.reserve(kVariants.size());
  options.configure.reserve(kVariants.size());
  for (const auto& v : kVariants) {
    options.names.emplace_back(v.name);
    options.configure.emplace_back([v](d9d::TrainerConfig& c) {
      d9d::model::set_fused_kernels(v.fused_kernels);
      c.cuda_graphs.enabled = v.cuda_graphs;
    });
  }
  options.only = o.variants;
  options.warmup_steps = o.warmup;
  options.flops_per_token = flops(false);
  options.peak_tflops = o.peak_tflops;
  options.print = false;  // after LoRA's MFU is set below
  std::optional<d9d::advise::MachineProfile> machine;
  if (!o.profile.empty()) {
    machine = d9d::advise::MachineProfile::from_file(o.profile);
    options.machine = &*machine;
  }
  auto comparison = compare_variants(Variants{}, ctx, cfg, options);
  for (auto& row : comparison.rows) {
    if (variant_named(row.name).frozen_base && row.mfu) {
      *row.mfu *= flops(true) / flops(false);
    }
  }
  if (ctx.is_main_process()) {
    std::fputs(comparison.table().c_str(), stdout);
    std::fflush(stdout);
    if (!o.json.empty()) {
      write_json(o.json, comparison.json());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train the quickstart's Qwen3 under speed-bench's Plan variants and compare them"};
  Options o;
  app.add_option("config", o.config_path, "trainer configuration (JSON), e.g. qwen3_0p6b_gpu.json")
      ->required();
  app.add_option("--data", o.data, "token file, replacing data.paths");
  app.add_option("--output", o.output, "output directory (one folder per variant inside)");
  app.add_option("--steps", o.steps, "optimizer steps per variant, replacing run.total_steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "steps per variant left out of the throughput (default 3)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--peak-tflops", o.peak_tflops,
                 "one device's peak TFLOP/s for the MFU column (e.g. 989 for H100/H200 bf16)")
      ->check(CLI::NonNegativeNumber);
  std::vector<std::string> names;
  names.reserve(kVariants.size());
  for (const auto& v : kVariants) {
    names.emplace_back(v.name);
  }
  app.add_option("--variants", o.variants, "the variants to run, comma-separated (default: all)")
      ->delimiter(',')
      ->check(CLI::IsMember(names));
  app.add_option("--json", o.json, "write the rows as JSON here (main rank)");
  app.add_option("--profile", o.profile,
                 "a machine profile (tools/gpu/profile-machine) for the predicted tokens/s column")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);
  return d9d::run_main(argc, argv, [&o] { return run(o); });
}
