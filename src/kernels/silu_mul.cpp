// d9d/kernels/silu_mul.cpp — schemas of the d9d::silu_mul ops, the CPU reference kernels, and the
// autograd wrapper shared by every device.
#include <cmath>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <d9d/kernels/silu_mul.hpp>

namespace d9d::kernels {
namespace detail {

void check_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad) {
  TORCH_CHECK(gate.defined() && up.defined(), "d9d::silu_mul: gate and up must be defined");
  TORCH_CHECK(at::isFloatingType(gate.scalar_type()),
              "d9d::silu_mul: gate must be floating point, got ", gate.scalar_type());
  for (const auto* other : {&up, &grad}) {
    if (!other->defined()) {
      continue;
    }
    const char* name = other == &up ? "up" : "grad";
    TORCH_CHECK(other->sizes() == gate.sizes(), "d9d::silu_mul: ", name, " has shape ",
                other->sizes(), ", gate has ", gate.sizes());
    TORCH_CHECK(other->scalar_type() == gate.scalar_type(), "d9d::silu_mul: ", name, " is ",
                other->scalar_type(), ", gate is ", gate.scalar_type());
    TORCH_CHECK(other->device() == gate.device(), "d9d::silu_mul: ", name, " is on ",
                other->device(), ", gate on ", gate.device());
  }
}

}  // namespace detail

namespace {

at::Tensor silu_mul_forward_cpu(const at::Tensor& gate_arg, const at::Tensor& up_arg) {
  detail::check_silu_mul(gate_arg, up_arg, at::Tensor());
  const at::Tensor gate = gate_arg.contiguous();
  const at::Tensor up = up_arg.contiguous();
  at::Tensor out = at::empty_like(gate);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, gate.scalar_type(), "d9d::silu_mul_forward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* g = gate.const_data_ptr<scalar_t>();
        const scalar_t* u = up.const_data_ptr<scalar_t>();
        scalar_t* h = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, gate.numel(), 4096, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const auto x = static_cast<acc_t>(g[i]);
            const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-x));
            h[i] = static_cast<scalar_t>(x * sig * static_cast<acc_t>(u[i]));
          }
        });
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cpu(const at::Tensor& grad_arg,
                                                         const at::Tensor& gate_arg,
                                                         const at::Tensor& up_arg) {
  detail::check_silu_mul(gate_arg, up_arg, grad_arg);
  const at::Tensor grad = grad_arg.contiguous();
  const at::Tensor gate = gate_arg.contiguous();
  const at::Tensor up = up_arg.contiguous();
  at::Tensor grad_gate = at::empty_like(gate);
  at::Tensor grad_up = at::empty_like(up);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, gate.scalar_type(), "d9d::silu_mul_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* dh = grad.const_data_ptr<scalar_t>();
        const scalar_t* g = gate.const_data_ptr<scalar_t>();
        const scalar_t* u = up.const_data_ptr<scalar_t>();
        scalar_t* dg = grad_gate.mutable_data_ptr<scalar_t>();
        scalar_t* du = grad_up.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, gate.numel(), 4096, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const auto x = static_cast<acc_t>(g[i]);
            const auto d = static_cast<acc_t>(dh[i]);
            const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-x));
            dg[i] = static_cast<scalar_t>(d * static_cast<acc_t>(u[i]) * sig *
                                          (acc_t(1) + x * (acc_t(1) - sig)));
            du[i] = static_cast<scalar_t>(d * x * sig);
          }
        });
      });
  return {grad_gate, grad_up};
}

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::silu_mul_forward", "")
                                 .typed<ForwardSig>();
  return handle;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::silu_mul_backward", "")
                                 .typed<BackwardSig>();
  return handle;
}

class SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up) {
    const at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({gate, up});
    return forward_op().call(gate, up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] = backward_op().call(grads[0].contiguous(), saved[0], saved[1]);
    return {grad_gate, grad_up};
  }
};

at::Tensor silu_mul_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return SiluMulFunction::apply(gate, up);
}

at::Tensor silu_mul_plain(const at::Tensor& gate, const at::Tensor& up) {
  return forward_op().call(gate, up);
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::silu_mul", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return handle.call(gate, up);
}

at::Tensor silu_mul_forward(const at::Tensor& gate, const at::Tensor& up) {
  return forward_op().call(gate, up);
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  return backward_op().call(grad, gate, up);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_forward(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) {
  m.impl("silu_mul_forward", &d9d::kernels::silu_mul_forward_cpu);
  m.impl("silu_mul_backward", &d9d::kernels::silu_mul_backward_cpu);
}

TORCH_LIBRARY_IMPL(d9d, Autograd, m) { m.impl("silu_mul", &d9d::kernels::silu_mul_autograd); }

TORCH_LIBRARY_IMPL(d9d, CompositeExplicitAutograd, m) {
  m.impl("silu_mul", &d9d::kernels::silu_mul_plain);
}
