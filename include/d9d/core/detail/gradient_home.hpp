// d9d/core/detail/gradient_home.hpp — where a parameter's gradient is wanted, told by its
// post-accumulate-grad hook (not a public API: Replicate's copy engine offers it, the library's
// linear layers in src/model/split_linear.cpp write there).
//
//   class Ready : public d9d::detail::GradientHome { ... at::Tensor home() override; };
//   torch::autograd::impl::set_post_acc_grad_hooks(param, std::make_unique<Ready>(...));
//   // a backward whose weight-gradient GEMM finds param.grad undefined:
//   if (auto* wants = d9d::detail::gradient_home_of(param)) {
//     at::Tensor home = wants->home();      // undefined: no home this time
//     at::mm_out(home, grad_out.t(), x);     // the product written there, returned as the gradient
//   }
//
// Replicate's copy engine sums gradients in a buffer the GPUs map into each other's memory
// (d9d/parallel/detail/copy_engine_reduce.hpp). A gradient made elsewhere is copied into its place
// there when its bucket launches: a device-to-device copy per parameter, on the SMs, beside the
// backward's kernels. The first product of a step written at its place saves that copy; autograd's
// AccumulateGrad keeps the returned tensor as .grad (no one else holds it: no copy), later
// microbatches add into it in place, and the reducer finds each gradient at its place already.
// Design note 0031 says why the first product is written there rather than the buffer zeroed.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function_hook.h>

namespace d9d::detail {

/// A post-accumulate-grad hook that also offers memory for its parameter's gradient.
class GradientHome : public torch::autograd::PostAccumulateGradHook {
 public:
  GradientHome() = default;
  ~GradientHome() override = default;
  GradientHome(const GradientHome&) = delete;
  GradientHome& operator=(const GradientHome&) = delete;
  GradientHome(GradientHome&&) = delete;
  GradientHome& operator=(GradientHome&&) = delete;

  /// A new tensor (no other owner), the parameter's sizes, contiguous, over the memory where the
  /// step's gradient should live, for its first contribution to overwrite; or undefined (none, or
  /// handed out already this step: a weight reached twice in one backward must not get it twice).
  /// Called from the autograd engine's threads.
  [[nodiscard]] virtual at::Tensor home() = 0;
};

/// The GradientHome among `param`'s post-accumulate-grad hooks, or null.
[[nodiscard]] GradientHome* gradient_home_of(const at::Tensor& param);

}  // namespace d9d::detail
