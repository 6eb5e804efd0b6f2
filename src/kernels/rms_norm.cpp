// d9d/kernels/rms_norm.cpp — schemas of the d9d::rms_norm ops, the CPU reference kernels, and
// the autograd wrapper shared by every device.
#include <cmath>
#include <optional>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <d9d/kernels/detail/rms_norm.hpp>
#include <d9d/kernels/rms_norm.hpp>

namespace d9d::kernels {
namespace detail {

at::ScalarType accumulate_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

at::ScalarType rms_norm_output_dtype(const at::Tensor& input,
                                     std::optional<at::ScalarType> out_dtype) {
  return out_dtype.value_or(input.scalar_type());
}

RowShape check_rms_norm_forward(const at::Tensor& input, const at::Tensor& weight,
                                at::ScalarType output) {
  TORCH_CHECK(input.defined() && weight.defined(),
              "d9d::rms_norm: input and weight must be defined");
  TORCH_CHECK(input.dim() >= 1,
              "d9d::rms_norm: input must have at least one dimension, got a scalar");
  TORCH_CHECK(at::isFloatingType(input.scalar_type()),
              "d9d::rms_norm: input must be floating point, got ", input.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1),
              "d9d::rms_norm: weight must have shape [", input.size(-1),
              "] (the input's last dimension), got ", weight.sizes());
  const auto in = input.scalar_type();
  const bool reduced = in == at::kBFloat16 || in == at::kHalf;
  const bool reduced_out = output == at::kBFloat16 || output == at::kHalf;
  const bool same = weight.scalar_type() == in && output == in;
  const bool float_weight = weight.scalar_type() == at::kFloat && reduced && output == in;
  const bool narrowing = in == at::kFloat && weight.scalar_type() == at::kFloat && reduced_out;
  TORCH_CHECK(weight.scalar_type() == in || (reduced && weight.scalar_type() == at::kFloat),
              "d9d::rms_norm: weight dtype ", weight.scalar_type(), " differs from input dtype ",
              in,
              " (a float32 weight is taken with bfloat16 and half inputs); cast the weight (e.g. "
              "weight.to(input.scalar_type()))");
  TORCH_CHECK(same || float_weight || narrowing, "d9d::rms_norm: no kernel for input ", in,
              ", weight ", weight.scalar_type(), ", output ", output,
              " (the output dtype differs from the input's only for a float32 input and weight "
              "with a bfloat16 or half output)");
  TORCH_CHECK(weight.device() == input.device(), "d9d::rms_norm: weight is on ", weight.device(),
              " but input is on ", input.device());
  const std::int64_t cols = input.size(-1);
  return {.rows = cols == 0 ? 0 : input.numel() / cols, .cols = cols};
}

RowShape check_rms_norm_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                 const at::Tensor& weight, const at::Tensor& rstd) {
  TORCH_CHECK(grad_output.defined(), "d9d::rms_norm_backward: grad_output must be defined");
  const RowShape shape = check_rms_norm_forward(input, weight, grad_output.scalar_type());
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "d9d::rms_norm_backward: grad_output shape ",
              grad_output.sizes(), " differs from input shape ", input.sizes());
  TORCH_CHECK(grad_output.device() == input.device() && rstd.device() == input.device(),
              "d9d::rms_norm_backward: grad_output, input and rstd must share a device");
  TORCH_CHECK(rstd.numel() == shape.rows, "d9d::rms_norm_backward: rstd has ", rstd.numel(),
              " elements, expected one per row (", shape.rows, ")");
  TORCH_CHECK(rstd.scalar_type() == accumulate_dtype(input.scalar_type()),
              "d9d::rms_norm_backward: rstd must be ", accumulate_dtype(input.scalar_type()),
              ", got ", rstd.scalar_type());
  return shape;
}

}  // namespace detail

namespace {

std::vector<std::int64_t> row_shape(const at::Tensor& input) {
  auto sizes = input.sizes().vec();
  sizes.pop_back();
  return sizes;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& input_arg,
                                                        const at::Tensor& weight_arg, double eps,
                                                        std::optional<at::ScalarType> out_dtype) {
  const auto out = detail::rms_norm_output_dtype(input_arg, out_dtype);
  const auto shape = detail::check_rms_norm_forward(input_arg, weight_arg, out);
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor weight = weight_arg.contiguous();
  at::Tensor output = at::empty_like(input, input.options().dtype(out));
  at::Tensor rstd = at::empty(row_shape(input),
                              input.options().dtype(detail::accumulate_dtype(input.scalar_type())));
  detail::dispatch_rms_norm_types(
      input.scalar_type(), weight.scalar_type(), out, [&](auto t, auto w_t, auto o_t) {
        using T = decltype(t);
        using W = decltype(w_t);
        using O = decltype(o_t);
        using acc_t = at::opmath_type<T>;
        const T* x = input.const_data_ptr<T>();
        const W* w = weight.const_data_ptr<W>();
        O* y = output.mutable_data_ptr<O>();
        acc_t* r = rstd.mutable_data_ptr<acc_t>();
        const std::int64_t n = shape.cols;
        at::parallel_for(0, shape.rows, 1, [&](std::int64_t begin, std::int64_t end) {
          for (std::int64_t row = begin; row < end; ++row) {
            const T* xr = x + row * n;  // NOLINT(cppcoreguidelines-pro-bounds-pointer-arithmetic)
            O* yr = y + row * n;        // NOLINT(cppcoreguidelines-pro-bounds-pointer-arithmetic)
            acc_t sum_sq = 0;
            for (std::int64_t j = 0; j < n; ++j) {
              const auto v = static_cast<acc_t>(xr[j]);
              sum_sq += v * v;
            }
            const acc_t rs =
                acc_t(1) / std::sqrt(sum_sq / static_cast<acc_t>(n) + static_cast<acc_t>(eps));
            r[row] = rs;
            for (std::int64_t j = 0; j < n; ++j) {
              yr[j] = static_cast<O>(static_cast<acc_t>(xr[j]) * rs * static_cast<acc_t>(w[j]));
            }
          }
        });
      });
  return {output, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_arg,
                                                         const at::Tensor& input_arg,
                                                         const at::Tensor& weight_arg,
                                                         const at::Tensor& rstd_arg) {
  const auto shape = detail::check_rms_norm_backward(grad_arg, input_arg, weight_arg, rstd_arg);
  const at::Tensor grad = grad_arg.contiguous();
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor weight = weight_arg.contiguous();
  const at::Tensor rstd = rstd_arg.contiguous();
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor grad_weight = at::empty_like(weight);
  detail::dispatch_rms_norm_types(
      input.scalar_type(), weight.scalar_type(), grad.scalar_type(),
      [&](auto t, auto w_t, auto o_t) {
        using T = decltype(t);
        using W = decltype(w_t);
        using O = decltype(o_t);
        using acc_t = at::opmath_type<T>;
        const O* dy = grad.const_data_ptr<O>();
        const T* x = input.const_data_ptr<T>();
        const W* w = weight.const_data_ptr<W>();
        const acc_t* r = rstd.const_data_ptr<acc_t>();
        T* dx = grad_input.mutable_data_ptr<T>();
        W* dw = grad_weight.mutable_data_ptr<W>();
        const std::int64_t n = shape.cols;
        const std::int64_t rows = shape.rows;
        // dx = rstd * (dy*w - xhat * mean(dy*w*xhat)), xhat = x*rstd
        at::parallel_for(0, rows, 1, [&](std::int64_t begin, std::int64_t end) {
          for (std::int64_t row = begin; row < end; ++row) {
            const std::int64_t off = row * n;
            const acc_t rs = r[row];
            acc_t dot = 0;
            for (std::int64_t j = 0; j < n; ++j) {
              dot += static_cast<acc_t>(dy[off + j]) * static_cast<acc_t>(w[j]) *
                     static_cast<acc_t>(x[off + j]);
            }
            const acc_t c = dot * rs * rs / static_cast<acc_t>(n);
            for (std::int64_t j = 0; j < n; ++j) {
              const acc_t g = static_cast<acc_t>(dy[off + j]) * static_cast<acc_t>(w[j]);
              dx[off + j] = static_cast<T>(rs * (g - static_cast<acc_t>(x[off + j]) * c));
            }
          }
        });
        // dw[j] = sum over rows of dy * xhat
        at::parallel_for(0, n, 1, [&](std::int64_t begin, std::int64_t end) {
          for (std::int64_t j = begin; j < end; ++j) {
            acc_t sum = 0;
            for (std::int64_t row = 0; row < rows; ++row) {
              sum +=
                  static_cast<acc_t>(dy[row * n + j]) * static_cast<acc_t>(x[row * n + j]) * r[row];
            }
            dw[j] = static_cast<W>(sum);
          }
        });
      });
  return {grad_input, grad_weight};
}

using ForwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double,
                                                      std::optional<at::ScalarType>);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&);
using RmsNormSig = at::Tensor(const at::Tensor&, const at::Tensor&, double,
                              std::optional<at::ScalarType>);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::rms_norm_forward", "")
                                 .typed<ForwardSig>();
  return handle;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::rms_norm_backward", "")
                                 .typed<BackwardSig>();
  return handle;
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, double eps,
                            std::optional<at::ScalarType> out_dtype) {
    const at::AutoDispatchBelowADInplaceOrView guard;
    auto [output, rstd] = forward_op().call(input, weight, eps, out_dtype);
    ctx->save_for_backward({input, weight, rstd});
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    // Both kernels read a non-contiguous gradient through .contiguous() themselves.
    auto [grad_input, grad_weight] = backward_op().call(grads[0], saved[0], saved[1], saved[2]);
    return {grad_input, grad_weight, at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& input, const at::Tensor& weight, double eps,
                             std::optional<at::ScalarType> out_dtype) {
  return RmsNormFunction::apply(input, weight, eps, out_dtype);
}

at::Tensor rms_norm_plain(const at::Tensor& input, const at::Tensor& weight, double eps,
                          std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(forward_op().call(input, weight, eps, out_dtype));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps,
                    std::optional<at::ScalarType> out_dtype) {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("d9d::rms_norm", "").typed<RmsNormSig>();
  return handle.call(input, weight, eps, out_dtype);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input,
                                                    const at::Tensor& weight, double eps,
                                                    std::optional<at::ScalarType> out_dtype) {
  return forward_op().call(input, weight, eps, out_dtype);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_output,
                                                     const at::Tensor& input,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd) {
  return backward_op().call(grad_output, input, weight, rstd);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def(
      "rms_norm(Tensor input, Tensor weight, float eps=1e-06, ScalarType? out_dtype=None) -> "
      "Tensor");
  m.def(
      "rms_norm_forward(Tensor input, Tensor weight, float eps, ScalarType? out_dtype=None) -> "
      "(Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor rstd) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) {
  m.impl("rms_norm_forward", &d9d::kernels::rms_norm_forward_cpu);
  m.impl("rms_norm_backward", &d9d::kernels::rms_norm_backward_cpu);
}

TORCH_LIBRARY_IMPL(d9d, Autograd, m) { m.impl("rms_norm", &d9d::kernels::rms_norm_autograd); }

TORCH_LIBRARY_IMPL(d9d, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &d9d::kernels::rms_norm_plain);
}
