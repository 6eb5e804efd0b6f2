// examples/common/preflight.hpp — the advisor's prediction for a Plan, printed before its Trainer
// is built when the config has an "advise" section (d9d/advise/preflight.hpp; docs/advise.md,
// "Pre-flight"). Examples 03 (dense Qwen3) and 05 (Qwen3-MoE) call it.
#pragma once

#include <cstdio>
#include <optional>
#include <stdexcept>

#include <d9d/advise/preflight.hpp>
#include <d9d/d9d.hpp>

namespace d9d::examples {

/// On the main rank, the pre-flight's lines for `Plan` on the world `ctx` forms. A bad "advise"
/// section is a config error; a mesh the world cannot form, or a batch it cannot split, is left
/// to the Trainer, which names it.
template <class Plan>
void print_preflight(const DistributedContext& ctx, const TrainerConfig& cfg) {
  if (!advise::preflight_settings(cfg).enabled) {
    return;
  }
  MeshShape shape;
  try {
    shape = resolve_mesh<typename Plan::mesh>(ctx.world_size(), cfg.mesh);
  } catch (const std::invalid_argument&) {
    return;
  }
  std::optional<advise::Preflight> advice;
  try {
    advice = advise::preflight<Plan>(cfg, shape);
  } catch (const std::invalid_argument&) {
    return;  // e.g. a batch the data-parallel ranks cannot split: the Trainer names it
  }
  if (advice && ctx.is_main_process()) {
    for (const auto& line : advice->lines) {
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
  }
}

}  // namespace d9d::examples
