// d9d/kernels/stochastic.cpp — schemas of the d9d::adamw_stochastic_ and d9d::copy_stochastic_
// ops and their CPU reference kernels (the same element formula and random bits as the CUDA ones).
#include <cstdint>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <d9d/kernels/detail/stochastic_rounding.hpp>
#include <d9d/kernels/stochastic.hpp>

namespace d9d::kernels {
namespace detail {

void check_adamw_stochastic(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs) {
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                  exp_avg_sqs.size() == params.size(),
              "d9d::adamw_stochastic_: the lists differ in length (params ", params.size(),
              ", grads ", grads.size(), ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ",
              exp_avg_sqs.size(), ")");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.scalar_type() == at::kBFloat16, "d9d::adamw_stochastic_: params[", i, "] is ",
                p.scalar_type(), "; the parameters must be bfloat16");
    TORCH_CHECK(p.is_contiguous(), "d9d::adamw_stochastic_: params[", i, "] is not contiguous");
    const std::pair<const char*, const at::Tensor*> others[] = {
        {"grads", &grads[i]}, {"exp_avgs", &exp_avgs[i]}, {"exp_avg_sqs", &exp_avg_sqs[i]}};
    for (const auto& [name, t] : others) {
      TORCH_CHECK(t->defined(), "d9d::adamw_stochastic_: ", name, "[", i, "] is undefined");
      TORCH_CHECK(t->sizes() == p.sizes(), "d9d::adamw_stochastic_: ", name, "[", i, "] has shape ",
                  t->sizes(), ", params[", i, "] has ", p.sizes());
      TORCH_CHECK(t->device() == p.device(), "d9d::adamw_stochastic_: ", name, "[", i, "] is on ",
                  t->device(), ", params[", i, "] on ", p.device());
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 || t->scalar_type() == at::kFloat,
                  "d9d::adamw_stochastic_: ", name, "[", i, "] is ", t->scalar_type(),
                  "; it must be bfloat16 or float32");
      TORCH_CHECK(t->is_contiguous(), "d9d::adamw_stochastic_: ", name, "[", i,
                  "] is not contiguous");
    }
    TORCH_CHECK(p.device() == params[0].device(), "d9d::adamw_stochastic_: params[", i, "] is on ",
                p.device(), ", params[0] on ", params[0].device());
    TORCH_CHECK(grads[i].scalar_type() == grads[0].scalar_type() &&
                    exp_avgs[i].scalar_type() == exp_avgs[0].scalar_type() &&
                    exp_avg_sqs[i].scalar_type() == exp_avgs[0].scalar_type(),
                "d9d::adamw_stochastic_: entry ", i,
                " differs in dtype from entry 0 (one dtype per list; the moments share theirs)");
  }
}

void check_copy_stochastic(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == at::kBFloat16, "d9d::copy_stochastic_: dst is ",
              dst.scalar_type(), "; it must be bfloat16");
  TORCH_CHECK(src.scalar_type() == at::kFloat, "d9d::copy_stochastic_: src is ", src.scalar_type(),
              "; it must be float32");
  TORCH_CHECK(dst.sizes() == src.sizes(), "d9d::copy_stochastic_: dst has shape ", dst.sizes(),
              ", src has ", src.sizes());
  TORCH_CHECK(dst.device() == src.device(), "d9d::copy_stochastic_: dst is on ", dst.device(),
              ", src on ", src.device());
  TORCH_CHECK(dst.is_contiguous(), "d9d::copy_stochastic_: dst is not contiguous");
}

}  // namespace detail

namespace {

float load(const void* base, bool bf16, int64_t i) {
  if (bf16) {
    return detail::bf16_bits_to_float(static_cast<const std::uint16_t*>(base)[i]);
  }
  return static_cast<const float*>(base)[i];
}

void store(void* base, bool bf16, int64_t i, float value, std::uint32_t random16) {
  if (bf16) {
    static_cast<std::uint16_t*>(base)[i] = detail::stochastic_bf16_bits(value, random16);
  } else {
    static_cast<float*>(base)[i] = value;
  }
}

void adamw_stochastic_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step, int64_t seed) {
  detail::check_adamw_stochastic(params, grads, exp_avgs, exp_avg_sqs);
  const auto scalars = detail::make_adamw_scalars(lr, beta1, beta2, eps, weight_decay, step);
  for (size_t t = 0; t < params.size(); ++t) {
    auto* p = static_cast<std::uint16_t*>(params[t].data_ptr());
    const void* g = grads[t].const_data_ptr();
    void* m = exp_avgs[t].data_ptr();
    void* v = exp_avg_sqs[t].data_ptr();
    const bool g16 = grads[t].scalar_type() == at::kBFloat16;
    const bool s16 = exp_avgs[t].scalar_type() == at::kBFloat16;
    at::parallel_for(0, params[t].numel(), 2048, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const std::uint64_t r =
            detail::random_bits(static_cast<std::uint64_t>(seed), t, static_cast<std::uint64_t>(i));
        float mv = load(m, s16, i);
        float vv = load(v, s16, i);
        const float updated = detail::adamw_element(detail::bf16_bits_to_float(p[i]),
                                                    load(g, g16, i), mv, vv, scalars);
        p[i] = detail::stochastic_bf16_bits(updated, static_cast<std::uint32_t>(r));
        store(m, s16, i, mv, static_cast<std::uint32_t>(r >> 16));
        store(v, s16, i, vv, static_cast<std::uint32_t>(r >> 32));
      }
    });
  }
}

void copy_stochastic_cpu(const at::Tensor& dst, const at::Tensor& src_arg, int64_t seed) {
  detail::check_copy_stochastic(dst, src_arg);
  const at::Tensor src = src_arg.contiguous();
  const float* in = src.const_data_ptr<float>();
  auto* out = static_cast<std::uint16_t*>(dst.data_ptr());
  at::parallel_for(0, src.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const std::uint64_t r =
          detail::random_bits(static_cast<std::uint64_t>(seed), 0, static_cast<std::uint64_t>(i));
      out[i] = detail::stochastic_bf16_bits(in[i], static_cast<std::uint32_t>(r));
    }
  });
}

}  // namespace

void adamw_stochastic_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, const AdamWStep& step, int64_t seed) {
  if (params.empty()) {
    return;
  }
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("d9d::adamw_stochastic_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double,
                      double, double, double, double, int64_t, int64_t)>();
  handle.call(params, grads, exp_avgs, exp_avg_sqs, step.lr, step.beta1, step.beta2, step.eps,
              step.weight_decay, step.step, seed);
}

void copy_stochastic_(const at::Tensor& dst, const at::Tensor& src, int64_t seed) {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::copy_stochastic_", "")
                                 .typed<void(const at::Tensor&, const at::Tensor&, int64_t)>();
  handle.call(dst, src, seed);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def(
      "adamw_stochastic_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, int step, int seed) -> ()");
  m.def("copy_stochastic_(Tensor(a!) dst, Tensor src, int seed) -> ()");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) {
  m.impl("adamw_stochastic_", &d9d::kernels::adamw_stochastic_cpu);
  m.impl("copy_stochastic_", &d9d::kernels::copy_stochastic_cpu);
}
