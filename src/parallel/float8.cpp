// d9d/parallel/float8.cpp — d9d::precision::Float8 applied to a model: the attention and MLP
// projections of every d9d::model::Attention and d9d::model::SwiGlu (the dense layers' MLP and a
// MoE layer's shared expert) get float8 GEMMs; the embedding, the head, the routers and the
// grouped experts keep the compute dtype. On a CUDA device a small float8 product runs first, so a
// device or build without float8 GEMMs fails at start-up with the fix, not in the first step.
#include <memory>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/kernels/float8.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/parallel/parallelize.hpp>

namespace d9d::parallel::detail {
namespace {

void check_float8_device(c10::Device device) {
  if (!device.is_cuda()) {
    return;  // the CPU runs the emulation
  }
  try {
    const auto a = at::ones({16, 16}, at::TensorOptions().device(device).dtype(at::kBFloat16));
    const auto q = kernels::float8_quantize(a, at::kFloat8_e4m3fn, /*rowwise=*/true);
    const auto y = kernels::float8_matmul(q, q, at::kBFloat16);
    if (y.sum().item<float>() != 16.0F * 16.0F * 16.0F) {
      throw std::runtime_error("a float8 product of ones gave " +
                               std::to_string(y.sum().item<float>()) + " instead of 4096");
    }
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    throw std::runtime_error(
        "d9d::precision::Float8: float8 GEMMs do not run on " + device.str() + " (" + why +
        "). They need d9d's CUDA kernels (a CUDA build: D9D_WITH_CUDA) and a GPU of compute "
        "capability 8.9 or newer (H100, H200, L40S). Fix: run on such a GPU, or use the plan's "
        "precision without Float8 (e.g. d9d::precision::Bf16Mixed)");
  }
}

}  // namespace

int apply_float8(ParallelModel& model, bool rowwise) {
  check_float8_device(model.mesh().context().device());
  int layers = 0;
  const auto set = [&](model::Linear& linear) {
    if (!linear.is_empty()) {
      linear->float8 =
          model::Float8Linear{.rowwise = rowwise, .weight = {}, .weight_transposed = {}};
      ++layers;
    }
  };
  for (const auto& module : model.modules()) {
    for (const auto& item : module->named_modules()) {
      if (auto attention = std::dynamic_pointer_cast<model::AttentionImpl>(item.value())) {
        set(attention->q_proj);
        set(attention->k_proj);
        set(attention->v_proj);
        set(attention->o_proj);
      } else if (auto mlp = std::dynamic_pointer_cast<model::SwiGluImpl>(item.value())) {
        set(mlp->gate_proj);
        set(mlp->up_proj);
        set(mlp->down_proj);
      }
    }
  }
  if (layers == 0) {
    throw std::invalid_argument(
        "d9d::precision::Float8: this rank's model has no d9d::model::Attention or "
        "d9d::model::SwiGlu, whose projections are the layers Float8 runs in float8, so it would "
        "change nothing. Fix: build the model from d9d/model/layers.hpp's Attention and SwiGlu, "
        "or use the plan's precision without Float8");
  }
  return layers;
}

}  // namespace d9d::parallel::detail
