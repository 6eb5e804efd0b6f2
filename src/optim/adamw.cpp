// d9d/optim/adamw.cpp — FusedAdamW: torch::optim::AdamW's state, ATen's fused multi-tensor update.
#include <map>
#include <stdexcept>
#include <tuple>

#include <ATen/ATen.h>

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

}  // namespace d9d::optim
