// d9d/core/gradient_home.cpp — the GradientHome among a parameter's hooks
// (d9d/core/detail/gradient_home.hpp).
#include <torch/csrc/autograd/variable.h>

#include <d9d/core/detail/gradient_home.hpp>

namespace d9d::detail {

GradientHome* gradient_home_of(const at::Tensor& param) {
  if (torch::autograd::impl::get_autograd_meta(param) == nullptr) {
    return nullptr;
  }
  const auto& hook = torch::autograd::impl::post_acc_grad_hooks(param);
  return dynamic_cast<GradientHome*>(hook.get());
}

}  // namespace d9d::detail
