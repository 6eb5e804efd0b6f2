// d9d/kernels/stochastic.hpp — bfloat16 parameters without a float32 master copy: AdamW whose
// update is rounded stochastically to bfloat16 (`d9d::adamw_stochastic_`), and the float32 →
// bfloat16 stochastic copy (`d9d::copy_stochastic_`), as LibTorch custom ops.
//
//   d9d::kernels::adamw_stochastic_(params, grads, exp_avgs, exp_avg_sqs,
//                                   {.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
//                                    .weight_decay = 0.1, .step = 7}, /*seed=*/1234);
//   d9d::kernels::copy_stochastic_(bf16_weight, fp32_weight, /*seed=*/1234);
//
// Round-to-nearest loses every update smaller than half a bfloat16 step (2^-8 relative): late in
// training most AdamW updates are. Stochastic rounding rounds up with probability equal to the
// dropped fraction, so the expected parameter follows the float32 trajectory (E[round(x)] = x).
// The random bits are counter-based (seed, tensor index in the list, element index), identical on
// CPU and CUDA and independent of the launch shape: a step is reproducible from its seed.
//
// adamw_stochastic_: parameters bfloat16; gradients bfloat16 or float32; the moments float32
// (exact) or bfloat16 (rounded stochastically too); each list's tensors share a device and dtypes,
// and the four lists match in length and shapes. The update is torch's AdamW (decoupled weight
// decay, bias corrections) in float32 per element. CUDA: one launch for the whole list (chunks of
// every tensor in one grid, 16-byte loads when aligned). Schemas (namespace `d9d`,
// src/kernels/stochastic.cpp):
//   adamw_stochastic_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs,
//                     Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps,
//                     float weight_decay, int step, int seed) -> ()
//   copy_stochastic_(Tensor(a!) dst, Tensor src, int seed) -> ()
// Kernels: CPU (the reference, src/kernels/stochastic.cpp) and CUDA (kernels/stochastic.cu).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace d9d::kernels {

/// One AdamW update's hyper-parameters; `step` counts from 1 (the bias corrections' exponent).
struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;
};

/// AdamW over every (param, grad, exp_avg, exp_avg_sq) of the lists in place, the parameters
/// rounded stochastically to bfloat16 under `seed`. No autograd.
void adamw_stochastic_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, const AdamWStep& step, int64_t seed);

/// dst (bfloat16) = src (float32, same shape and device) rounded stochastically under `seed`.
void copy_stochastic_(const at::Tensor& dst, const at::Tensor& src, int64_t seed);

namespace detail {

/// Checks adamw_stochastic_'s lists (lengths, shapes, devices, dtypes, contiguity).
void check_adamw_stochastic(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs);

/// Checks copy_stochastic_'s arguments.
void check_copy_stochastic(const at::Tensor& dst, const at::Tensor& src);

}  // namespace detail
}  // namespace d9d::kernels
