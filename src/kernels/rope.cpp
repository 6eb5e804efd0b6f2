// d9d/kernels/rope.cpp — schemas of the d9d::rope ops, the CPU reference kernel, and the autograd
// wrapper shared by every device.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <d9d/kernels/rope.hpp>

namespace d9d::kernels {
namespace detail {

RopeShape check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.defined() && cos.defined() && sin.defined(),
              "d9d::rope: x, cos and sin must be defined");
  TORCH_CHECK(x.dim() >= 3, "d9d::rope: x must be [..., T, heads, D], got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "d9d::rope: x must be floating point, got ",
              x.scalar_type());
  const int64_t dim = x.size(-1);
  TORCH_CHECK(dim % 2 == 0, "d9d::rope: the last dimension must be even, got ", dim);
  const int64_t positions = x.size(-3);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == positions && cos.size(1) == dim / 2,
              "d9d::rope: cos must be [T, D/2] = [", positions, ", ", dim / 2, "], got ",
              cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), "d9d::rope: sin must have cos's shape ", cos.sizes(),
              ", got ", sin.sizes());
  const auto table = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(cos.scalar_type() == table && sin.scalar_type() == table, "d9d::rope: cos and sin ",
              "must be ", table, " for ", x.scalar_type(), " inputs, got ", cos.scalar_type(),
              " and ", sin.scalar_type());
  TORCH_CHECK(cos.device() == x.device() && sin.device() == x.device(),
              "d9d::rope: cos and sin must be on x's device ", x.device());
  const int64_t heads = x.size(-2);
  return {.rows = dim == 0 ? 0 : x.numel() / dim,
          .positions = positions,
          .heads = heads,
          .half = dim / 2};
}

}  // namespace detail

namespace {

at::Tensor rope_forward_cpu(const at::Tensor& x_arg, const at::Tensor& cos_arg,
                            const at::Tensor& sin_arg, bool inverse) {
  const auto shape = detail::check_rope(x_arg, cos_arg, sin_arg);
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor cos = cos_arg.contiguous();
  const at::Tensor sin = sin_arg.contiguous();
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "d9d::rope_forward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* in = x.const_data_ptr<scalar_t>();
        const acc_t* c = cos.const_data_ptr<acc_t>();
        const acc_t* s = sin.const_data_ptr<acc_t>();
        scalar_t* out = y.mutable_data_ptr<scalar_t>();
        const int64_t half = shape.half;
        const acc_t sign = inverse ? acc_t(-1) : acc_t(1);
        at::parallel_for(0, shape.rows, 16, [&](int64_t begin, int64_t end) {
          for (int64_t row = begin; row < end; ++row) {
            const int64_t t = (row / shape.heads) % shape.positions;
            const int64_t base = row * 2 * half;
            for (int64_t i = 0; i < half; ++i) {
              const acc_t ci = c[t * half + i];
              const acc_t si = sign * s[t * half + i];
              const auto x1 = static_cast<acc_t>(in[base + i]);
              const auto x2 = static_cast<acc_t>(in[base + half + i]);
              out[base + i] = static_cast<scalar_t>(x1 * ci - x2 * si);
              out[base + half + i] = static_cast<scalar_t>(x2 * ci + x1 * si);
            }
          }
        });
      });
  return y;
}

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("d9d::rope_forward", "").typed<ForwardSig>();
  return handle;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& cos, const at::Tensor& sin) {
    const at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({cos, sin});
    return forward_op().call(x, cos, sin, false);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    // The rotation is orthogonal: its transpose rotates by minus the angles.
    return {forward_op().call(grads[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rope_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RopeFunction::apply(x, cos, sin);
}

at::Tensor rope_plain(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return forward_op().call(x, cos, sin, false);
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("d9d::rope", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return handle.call(x, cos, sin);
}

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        bool inverse) {
  return forward_op().call(x, cos, sin, inverse);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_forward(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) { m.impl("rope_forward", &d9d::kernels::rope_forward_cpu); }

TORCH_LIBRARY_IMPL(d9d, Autograd, m) { m.impl("rope", &d9d::kernels::rope_autograd); }

TORCH_LIBRARY_IMPL(d9d, CompositeExplicitAutograd, m) { m.impl("rope", &d9d::kernels::rope_plain); }
