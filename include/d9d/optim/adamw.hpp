// d9d/optim/adamw.hpp — AdamW with the multi-tensor fused kernel (one launch per group of
// parameters of a device and dtype, not a dozen per parameter).
//
//   d9d::optim::FusedAdamW optimizer(param_groups, torch::optim::AdamWOptions(3e-4));
//   optimizer.step();   // at::_fused_adamw_ (CUDA and CPU kernels), the same update as AdamW
//
// A torch::optim::AdamW whose step() runs ATen's fused AdamW over each parameter group: the
// options, the parameter groups and the per-parameter state (AdamWParamState: exp_avg,
// exp_avg_sq, step) are AdamW's, so checkpoints read and restore it unchanged. The update is the
// same formula (decoupled weight decay, bias corrections), computed per element in float (double
// for double parameters) — equal to AdamW's to rounding, not bit for bit. The kernel reads each
// parameter's step count from a float32 tensor on the parameter's device, which step() advances
// (one multi-tensor add) before the update; a step count changed from outside (a restored
// checkpoint) is picked up at the next step. amsgrad is not supported.
//
//   d9d::optim::StochasticAdamW sr(param_groups, torch::optim::AdamWOptions(3e-4),
//                                  {.seed = 1234, .state_dtype = at::kFloat});
//   sr.step();   // bfloat16 parameters updated without a float32 master copy
//
// StochasticAdamW is the optimizer of precision::Bf16Params<StochasticRounding>: bfloat16
// parameters (and gradients), the moments in `state_dtype` (float32, or bfloat16 rounded
// stochastically too), one d9d::adamw_stochastic_ launch per (device, dtypes, step) bucket
// (d9d/kernels/stochastic.hpp). The rounding bits of a step come from `seed` and the step count,
// so a resumed run draws what an uninterrupted one would. Its state is AdamW's (AdamWParamState),
// checkpointed the same way.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/optim/adamw.h>

namespace d9d::optim {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;

 private:
  // Per parameter: the kernel's step tensor and the step count it holds.
  std::unordered_map<c10::TensorImpl*, std::pair<at::Tensor, int64_t>> steps_;
};

/// StochasticAdamW's own options.
struct StochasticOptions {
  uint64_t seed = 0;                        ///< the rounding bits' seed (with the step count)
  at::ScalarType state_dtype = at::kFloat;  ///< of exp_avg and exp_avg_sq: kFloat or kBFloat16
};

class StochasticAdamW : public torch::optim::AdamW {
 public:
  StochasticAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                  torch::optim::AdamWOptions defaults, StochasticOptions options = {});
  torch::Tensor step(LossClosure closure = nullptr) override;

  [[nodiscard]] const StochasticOptions& stochastic_options() const { return options_; }

 private:
  StochasticOptions options_;
};

}  // namespace d9d::optim
