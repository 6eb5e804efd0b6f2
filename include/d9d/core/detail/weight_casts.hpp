// d9d/core/detail/weight_casts.hpp — a training step's weights cast to the compute dtype once, not
// once per microbatch (not a public API: the train steps open the scope, the library's linear
// layers in src/model/split_linear.cpp cast through it).
//
//   {
//     const d9d::detail::WeightCastScope casts(/*enabled=*/microbatches > 1);
//     for (const auto& mb : microbatches) { /* forward and backward */ }
//   }  // the cached casts are freed here, before the optimizer changes the weights
//
// Under bfloat16 autocast over float32 parameters (Bf16Mixed) every linear layer casts its weight
// for its forward. A step of m microbatches (gradient accumulation, or a pipeline's program) would
// cast every weight m times: m kernels and m bfloat16 copies (each microbatch in flight keeps its
// own for the backward). While a scope is open, cast_weight() returns the copy it made earlier in
// the step for the same weight, as long as it still holds the same values: the same tensor (a
// weak reference keeps its address from being reused), at the same memory, with the same version
// counter (every in-place write through autograd-visible tensors moves it) and sizes. The cache is
// shared by all threads (the autograd engine's threads run recomputed forwards) behind a mutex,
// and freed when the outermost scope closes. Costs the bfloat16 copies of the weights the layers
// cast (2 bytes per parameter) from their first forward to the end of the scope; saves m - 1
// casts per weight and step, and under a pipeline the copies of the other microbatches in flight.
#pragma once

#include <ATen/core/Tensor.h>

namespace d9d::detail {

/// Caches cast_weight()'s copies while alive when `enabled` (scopes nest, on any thread; the
/// outermost one's end frees them).
class WeightCastScope {
 public:
  explicit WeightCastScope(bool enabled);
  ~WeightCastScope();
  WeightCastScope(const WeightCastScope&) = delete;
  WeightCastScope& operator=(const WeightCastScope&) = delete;
  WeightCastScope(WeightCastScope&&) = delete;
  WeightCastScope& operator=(WeightCastScope&&) = delete;

 private:
  bool enabled_;
};

/// `weight` in `dtype` (as weight.to(dtype), without its autograd history: call it where gradient
/// mode is off, e.g. in an autograd function's forward): the copy made earlier in the open scope
/// when it still holds the weight's values, else a new one (kept when a scope is open and
/// `weight` is a leaf tensor, as parameters are). `weight` itself when it has the dtype already.
[[nodiscard]] at::Tensor cast_weight(const at::Tensor& weight, at::ScalarType dtype);

/// How many casts the open scopes hold (for tests).
[[nodiscard]] std::size_t cached_weight_casts();

}  // namespace d9d::detail
