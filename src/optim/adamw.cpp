// d9d/optim/adamw.cpp — FusedAdamW: torch::optim::AdamW's state, ATen's fused multi-tensor update.
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

#include <d9d/kernels/detail/stochastic_rounding.hpp>
#include <d9d/kernels/stochastic.hpp>
#include <d9d/optim/adamw.hpp>

namespace d9d::optim {

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    const at::AutoGradMode enable(true);
    loss = closure();
  }
  const at::NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (options.amsgrad()) {
      throw std::invalid_argument("d9d::optim::FusedAdamW: amsgrad is not supported");
    }
    // One fused call per (device, dtype) of the group's parameters.
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    };
    std::map<std::pair<std::string, int>, Lists> buckets;
    for (auto& param : group.params()) {
      if (!param.grad().defined() || param.numel() == 0) {
        continue;
      }
      auto* key = param.unsafeGetTensorImpl();
      auto& slot = state()[key];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(param, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& adamw = static_cast<torch::optim::AdamWParamState&>(*slot);
      auto& counter = steps_[key];
      if (!counter.first.defined() || counter.second != adamw.step() ||
          counter.first.device() != param.device()) {
        counter = {at::full({}, static_cast<double>(adamw.step()),
                            at::TensorOptions().dtype(at::kFloat).device(param.device())),
                   adamw.step()};
      }
      auto& lists = buckets[{param.device().str(), static_cast<int>(param.scalar_type())}];
      lists.params.push_back(param);
      lists.grads.push_back(param.grad());
      lists.exp_avgs.push_back(adamw.exp_avg());
      lists.exp_avg_sqs.push_back(adamw.exp_avg_sq());
      lists.steps.push_back(counter.first);
      adamw.step(adamw.step() + 1);  // the tensor follows below, as torch.optim's fused AdamW does
      ++counter.second;
    }
    const auto [beta1, beta2] = options.betas();
    for (auto& [key, lists] : buckets) {
      at::_foreach_add_(lists.steps, 1);  // the kernel reads the step count, it does not count
      at::_fused_adamw_(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs,
                        /*max_exp_avg_sqs=*/{}, lists.steps, options.lr(), beta1, beta2,
                        options.weight_decay(), options.eps(), /*amsgrad=*/false,
                        /*maximize=*/false);
    }
  }
  return loss;
}

StochasticAdamW::StochasticAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                                 torch::optim::AdamWOptions defaults, StochasticOptions options)
    : torch::optim::AdamW(std::move(groups), std::move(defaults)), options_(options) {
  if (options_.state_dtype != at::kFloat && options_.state_dtype != at::kBFloat16) {
    throw std::invalid_argument(
        std::string("d9d::optim::StochasticAdamW: the moments are float32 or bfloat16, not ") +
        c10::toString(options_.state_dtype));
  }
}

torch::Tensor StochasticAdamW::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    const at::AutoGradMode enable(true);
    loss = closure();
  }
  const at::NoGradGuard no_grad;
  uint64_t bucket_number = 0;  // distinct bits for each launch of the step
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (options.amsgrad()) {
      throw std::invalid_argument("d9d::optim::StochasticAdamW: amsgrad is not supported");
    }
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    };
    // One launch per device, gradient dtype, moment dtype and step count.
    std::map<std::tuple<std::string, int, int, int64_t>, Lists> buckets;
    for (auto& param : group.params()) {
      if (!param.grad().defined() || param.numel() == 0) {
        continue;
      }
      if (param.scalar_type() != at::kBFloat16) {
        throw std::invalid_argument(
            std::string("d9d::optim::StochasticAdamW: the parameters must be bfloat16, one is ") +
            c10::toString(param.scalar_type()) + " (use precision::Bf16Params, which casts them)");
      }
      auto& slot = state()[param.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(param, param.options().dtype(options_.state_dtype)));
        fresh->exp_avg_sq(at::zeros_like(param, param.options().dtype(options_.state_dtype)));
        slot = std::move(fresh);
      }
      auto& adamw = static_cast<torch::optim::AdamWParamState&>(*slot);
      adamw.step(adamw.step() + 1);
      auto& lists = buckets[{param.device().str(), static_cast<int>(param.grad().scalar_type()),
                             static_cast<int>(adamw.exp_avg().scalar_type()), adamw.step()}];
      lists.params.push_back(param);
      lists.grads.push_back(param.grad().contiguous());
      lists.exp_avgs.push_back(adamw.exp_avg());
      lists.exp_avg_sqs.push_back(adamw.exp_avg_sq());
    }
    const auto [beta1, beta2] = options.betas();
    for (auto& [key, lists] : buckets) {
      const int64_t step_count = std::get<3>(key);
      // The launch's bits: the seed, the step count and the launch's number in the step mixed
      // (a resumed run draws what an uninterrupted one would).
      const auto seed = static_cast<int64_t>(kernels::detail::mix64(
          options_.seed ^
          kernels::detail::mix64((static_cast<uint64_t>(step_count) << 16) ^ bucket_number++)));
      kernels::adamw_stochastic_(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs,
                                 {.lr = options.lr(),
                                  .beta1 = beta1,
                                  .beta2 = beta2,
                                  .eps = options.eps(),
                                  .weight_decay = options.weight_decay(),
                                  .step = step_count},
                                 seed);
    }
  }
  return loss;
}

}  // namespace d9d::optim
