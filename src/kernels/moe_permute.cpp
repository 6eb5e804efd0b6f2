// d9d/kernels/moe_permute.cpp — schemas of the d9d::moe_route_indices / moe_permute /
// moe_unpermute ops, the CPU reference kernels (loops written from the definitions in
// d9d/kernels/moe_permute.hpp), and the autograd wrappers shared by every device.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <d9d/kernels/moe_permute.hpp>

namespace d9d::kernels {
namespace detail {

int64_t check_moe_route(const at::Tensor& chosen, int64_t num_experts, int64_t top_k) {
  TORCH_CHECK(chosen.defined(), "d9d::moe_route_indices: chosen must be defined");
  TORCH_CHECK(chosen.scalar_type() == at::kLong,
              "d9d::moe_route_indices: chosen must be int64 (the router's top-k indices), got ",
              chosen.scalar_type());
  TORCH_CHECK(num_experts >= 1, "d9d::moe_route_indices: num_experts = ", num_experts,
              " must be >= 1");
  TORCH_CHECK(top_k >= 1, "d9d::moe_route_indices: top_k = ", top_k, " must be >= 1");
  const int64_t pairs = chosen.numel();
  TORCH_CHECK(pairs % top_k == 0, "d9d::moe_route_indices: chosen has ", pairs,
              " elements, not a multiple of top_k = ", top_k);
  TORCH_CHECK(pairs < std::numeric_limits<int32_t>::max(), "d9d::moe_route_indices: ", pairs,
              " (token, expert) pairs; at most 2^31 - 2 are supported");
  return pairs;
}

void check_moe_indices(const char* op, const at::Tensor& rows_like, const at::Tensor& token,
                       const at::Tensor& position, int64_t tokens) {
  TORCH_CHECK(rows_like.defined() && rows_like.dim() == 2, "d9d::", op,
              ": the rows must be a 2-D tensor [rows, hidden], got ",
              rows_like.defined() ? rows_like.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isFloatingType(rows_like.scalar_type()), "d9d::", op,
              ": the rows must be floating point, got ", rows_like.scalar_type());
  if (token.defined()) {
    TORCH_CHECK(token.dim() == 1 && token.scalar_type() == at::kLong, "d9d::", op,
                ": token must be a 1-D int64 tensor, got ", token.scalar_type(), " ",
                token.sizes());
    TORCH_CHECK(token.device() == rows_like.device(), "d9d::", op, ": token is on ", token.device(),
                ", the rows on ", rows_like.device());
  }
  if (position.defined()) {
    TORCH_CHECK(position.dim() == 2 && position.scalar_type() == at::kLong, "d9d::", op,
                ": position must be a 2-D int64 tensor [tokens, top_k], got ",
                position.scalar_type(), " ", position.sizes());
    TORCH_CHECK(position.device() == rows_like.device(), "d9d::", op, ": position is on ",
                position.device(), ", the rows on ", rows_like.device());
    TORCH_CHECK(tokens < 0 || position.size(0) == tokens, "d9d::", op, ": position has ",
                position.size(0), " rows, x has ", tokens, " tokens");
    TORCH_CHECK(!token.defined() || token.numel() <= position.numel(), "d9d::", op, ": token has ",
                token.numel(), " entries, more than the ", position.numel(), " routed pairs");
  }
}

void check_moe_unpermute(const at::Tensor& outputs, const at::Tensor& weights,
                         const at::Tensor& position, const at::Tensor& grad) {
  check_moe_indices("moe_unpermute", outputs, at::Tensor(), position, -1);
  TORCH_CHECK(weights.defined() && weights.sizes() == position.sizes(),
              "d9d::moe_unpermute: weights must have position's shape ", position.sizes(),
              " ([tokens, top_k]), got ", weights.defined() ? weights.sizes() : at::IntArrayRef{});
  TORCH_CHECK(weights.scalar_type() == outputs.scalar_type(), "d9d::moe_unpermute: weights are ",
              weights.scalar_type(), ", outputs ", outputs.scalar_type(),
              "; cast the weights (e.g. weights.to(outputs.scalar_type()))");
  TORCH_CHECK(weights.device() == outputs.device(), "d9d::moe_unpermute: weights are on ",
              weights.device(), ", outputs on ", outputs.device());
  if (grad.defined()) {
    TORCH_CHECK(
        grad.dim() == 2 && grad.size(0) == position.size(0) && grad.size(1) == outputs.size(1),
        "d9d::moe_unpermute: grad must be [", position.size(0), ", ", outputs.size(1), "], got ",
        grad.sizes());
    TORCH_CHECK(grad.scalar_type() == outputs.scalar_type() && grad.device() == outputs.device(),
                "d9d::moe_unpermute: grad is ", grad.scalar_type(), " on ", grad.device(),
                ", outputs ", outputs.scalar_type(), " on ", outputs.device());
  }
}

}  // namespace detail

namespace {

using RouteResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The counting sort of the definition: each pair's place in its expert's run (token order), the
// kept ones listed first by expert, then the dropped ones by expert.
RouteResult moe_route_indices_cpu(const at::Tensor& chosen_arg, int64_t num_experts, int64_t top_k,
                                  int64_t capacity) {
  const int64_t pairs = detail::check_moe_route(chosen_arg, num_experts, top_k);
  const at::Tensor chosen = chosen_arg.contiguous();
  const auto options = chosen.options();
  at::Tensor order = at::empty({pairs}, options);
  at::Tensor token = at::empty({pairs}, options);
  at::Tensor position = at::empty({pairs / top_k, top_k}, options);
  at::Tensor counts = at::zeros({num_experts}, options);
  at::Tensor kept_counts = at::empty({num_experts}, options);
  const int64_t* expert = chosen.const_data_ptr<int64_t>();
  int64_t* count = counts.mutable_data_ptr<int64_t>();
  int64_t* kept = kept_counts.mutable_data_ptr<int64_t>();
  std::vector<int64_t> place(static_cast<std::size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = expert[p];
    TORCH_CHECK(e >= 0 && e < num_experts, "d9d::moe_route_indices: chosen[", p, "] = ", e,
                " is not an expert in [0, ", num_experts, ")");
    place[static_cast<std::size_t>(p)] = count[e]++;
  }
  std::vector<int64_t> kept_start(static_cast<std::size_t>(num_experts));
  std::vector<int64_t> dropped_start(static_cast<std::size_t>(num_experts));
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    kept[e] = capacity < 0 ? count[e] : std::min(count[e], capacity);
    kept_start[static_cast<std::size_t>(e)] = total;
    total += kept[e];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    dropped_start[static_cast<std::size_t>(e)] = total;
    total += count[e] - kept[e];
  }
  int64_t* out_order = order.mutable_data_ptr<int64_t>();
  int64_t* out_token = token.mutable_data_ptr<int64_t>();
  int64_t* out_position = position.mutable_data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    const auto e = static_cast<std::size_t>(expert[p]);
    const int64_t at = place[static_cast<std::size_t>(p)];
    const bool keep = capacity < 0 || at < capacity;
    const int64_t dest = keep ? kept_start[e] + at : dropped_start[e] + (at - capacity);
    out_order[dest] = p;
    out_token[dest] = p / top_k;
    out_position[p] = keep ? dest : -1;
  }
  return {order, token, position, counts, kept_counts};
}

at::Tensor moe_permute_forward_cpu(const at::Tensor& x_arg, const at::Tensor& token_arg) {
  detail::check_moe_indices("moe_permute_forward", x_arg, token_arg, at::Tensor(), -1);
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor token = token_arg.contiguous();
  const int64_t tokens = x.size(0);
  const int64_t rows = token.numel();
  at::Tensor out = at::empty({rows, x.size(1)}, x.options());
  const auto bytes = static_cast<std::size_t>(x.size(1)) * x.element_size();
  const auto* from = static_cast<const char*>(x.const_data_ptr());
  auto* to = static_cast<char*>(out.mutable_data_ptr());
  const int64_t* index = token.const_data_ptr<int64_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = index[i];
      TORCH_CHECK(t >= 0 && t < tokens, "d9d::moe_permute: token[", i, "] = ", t,
                  " is not a row of x [", tokens, ", ...]");
      if (bytes > 0) {
        std::memcpy(to + static_cast<std::size_t>(i) * bytes,
                    from + static_cast<std::size_t>(t) * bytes, bytes);
      }
    }
  });
  return out;
}

// Token t's kept positions (pairs with position >= 0), increasing: the order in which
// index_add over the permuted rows adds them.
void kept_positions(const char* op, const int64_t* position, int64_t t, int64_t top_k, int64_t rows,
                    std::vector<std::pair<int64_t, int64_t>>& mine) {
  mine.clear();
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t i = position[t * top_k + j];
    if (i >= 0) {
      TORCH_CHECK(i < rows, "d9d::", op, ": position[", t, ", ", j, "] = ", i, " is past the ",
                  rows, " permuted rows");
      mine.emplace_back(i, j);
    }
  }
  std::sort(mine.begin(), mine.end());
}

// out[t] = the sum over token t's kept pairs, in increasing position, of rows[position[t, j]]
// (times weights[t, j] when weights is defined, each product rounded to the op-math type first),
// accumulated in the op-math type and rounded once: moe_permute's backward (no weights) and
// moe_unpermute's forward. Arguments checked by the caller.
at::Tensor sum_kept_rows(const char* op, const at::Tensor& rows_arg, const at::Tensor& weights_arg,
                         const at::Tensor& position_arg) {
  const at::Tensor source = rows_arg.contiguous();
  const at::Tensor weights = weights_arg.defined() ? weights_arg.contiguous() : at::Tensor();
  const at::Tensor position = position_arg.contiguous();
  const int64_t tokens = position.size(0);
  const int64_t top_k = position.size(1);
  const int64_t rows = source.size(0);
  const int64_t hidden = source.size(1);
  at::Tensor out = at::empty({tokens, hidden}, source.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, source.scalar_type(), "d9d::moe_sum_kept_rows_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* o = source.const_data_ptr<scalar_t>();
        const scalar_t* w = weights.defined() ? weights.const_data_ptr<scalar_t>() : nullptr;
        const int64_t* pos = position.const_data_ptr<int64_t>();
        scalar_t* y = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
          std::vector<std::pair<int64_t, int64_t>> mine;
          std::vector<acc_t> acc(static_cast<std::size_t>(hidden));
          for (int64_t t = begin; t < end; ++t) {
            kept_positions(op, pos, t, top_k, rows, mine);
            std::fill(acc.begin(), acc.end(), acc_t(0));
            for (const auto& [i, j] : mine) {
              if (w == nullptr) {
                for (int64_t h = 0; h < hidden; ++h) {
                  acc[static_cast<std::size_t>(h)] += static_cast<acc_t>(o[i * hidden + h]);
                }
                continue;
              }
              const auto weight = static_cast<acc_t>(w[t * top_k + j]);
              for (int64_t h = 0; h < hidden; ++h) {
                const acc_t product = static_cast<acc_t>(o[i * hidden + h]) * weight;
                acc[static_cast<std::size_t>(h)] += product;
              }
            }
            for (int64_t h = 0; h < hidden; ++h) {
              y[t * hidden + h] = static_cast<scalar_t>(acc[static_cast<std::size_t>(h)]);
            }
          }
        });
      });
  return out;
}

at::Tensor moe_permute_backward_cpu(const at::Tensor& grad_arg, const at::Tensor& position_arg) {
  detail::check_moe_indices("moe_permute_backward", grad_arg, at::Tensor(), position_arg, -1);
  return sum_kept_rows("moe_permute", grad_arg, at::Tensor(), position_arg);
}

at::Tensor moe_unpermute_forward_cpu(const at::Tensor& outputs_arg, const at::Tensor& weights_arg,
                                     const at::Tensor& position_arg) {
  detail::check_moe_unpermute(outputs_arg, weights_arg, position_arg, at::Tensor());
  return sum_kept_rows("moe_unpermute", outputs_arg, weights_arg, position_arg);
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward_cpu(const at::Tensor& grad_arg,
                                                              const at::Tensor& outputs_arg,
                                                              const at::Tensor& weights_arg,
                                                              const at::Tensor& position_arg) {
  detail::check_moe_unpermute(outputs_arg, weights_arg, position_arg, grad_arg);
  const at::Tensor grad = grad_arg.contiguous();
  const at::Tensor outputs = outputs_arg.contiguous();
  const at::Tensor weights = weights_arg.contiguous();
  const at::Tensor position = position_arg.contiguous();
  const int64_t top_k = position.size(1);
  const int64_t pairs = position.numel();
  const int64_t rows = outputs.size(0);
  const int64_t hidden = outputs.size(1);
  at::Tensor grad_outputs = at::empty_like(outputs);
  at::Tensor grad_weights = at::empty_like(weights);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, outputs.scalar_type(), "d9d::moe_unpermute_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* dy = grad.const_data_ptr<scalar_t>();
        const scalar_t* o = outputs.const_data_ptr<scalar_t>();
        const scalar_t* w = weights.const_data_ptr<scalar_t>();
        const int64_t* pos = position.const_data_ptr<int64_t>();
        scalar_t* d_o = grad_outputs.mutable_data_ptr<scalar_t>();
        scalar_t* d_w = grad_weights.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
          for (int64_t p = begin; p < end; ++p) {
            const int64_t i = pos[p];
            if (i < 0) {
              d_w[p] = scalar_t(0);
              continue;
            }
            TORCH_CHECK(i < rows, "d9d::moe_unpermute: position[", p / top_k, ", ", p % top_k,
                        "] = ", i, " is past the ", rows, " permuted rows");
            const int64_t t = p / top_k;
            const auto weight = static_cast<acc_t>(w[p]);
            acc_t dot(0);
            for (int64_t h = 0; h < hidden; ++h) {
              const auto g = static_cast<acc_t>(dy[t * hidden + h]);
              d_o[i * hidden + h] = static_cast<scalar_t>(g * weight);
              dot += g * static_cast<acc_t>(o[i * hidden + h]);
            }
            d_w[p] = static_cast<scalar_t>(dot);
          }
        });
      });
  return {grad_outputs, grad_weights};
}

// ---- dispatch and autograd ---------------------------------------------------------------------

using RouteSig = RouteResult(const at::Tensor&, int64_t, int64_t, int64_t);
using PermuteSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using TwoTensorSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using UnpermuteBackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                                const at::Tensor&,
                                                                const at::Tensor&,
                                                                const at::Tensor&);

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// One handle per op, looked up once.
const c10::TypedOperatorHandle<RouteSig>& route_op() {
  static const auto handle = find_op<RouteSig>("d9d::moe_route_indices");
  return handle;
}
const c10::TypedOperatorHandle<PermuteSig>& permute_op() {
  static const auto handle = find_op<PermuteSig>("d9d::moe_permute");
  return handle;
}
const c10::TypedOperatorHandle<TwoTensorSig>& permute_forward_op() {
  static const auto handle = find_op<TwoTensorSig>("d9d::moe_permute_forward");
  return handle;
}
const c10::TypedOperatorHandle<TwoTensorSig>& permute_backward_op() {
  static const auto handle = find_op<TwoTensorSig>("d9d::moe_permute_backward");
  return handle;
}
const c10::TypedOperatorHandle<PermuteSig>& unpermute_op() {
  static const auto handle = find_op<PermuteSig>("d9d::moe_unpermute");
  return handle;
}
const c10::TypedOperatorHandle<PermuteSig>& unpermute_forward_op() {
  static const auto handle = find_op<PermuteSig>("d9d::moe_unpermute_forward");
  return handle;
}
const c10::TypedOperatorHandle<UnpermuteBackwardSig>& unpermute_backward_op() {
  static const auto handle = find_op<UnpermuteBackwardSig>("d9d::moe_unpermute_backward");
  return handle;
}

class MoePermuteFunction : public torch::autograd::Function<MoePermuteFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& token, const at::Tensor& position) {
    const at::AutoDispatchBelowADInplaceOrView guard;
    detail::check_moe_indices("moe_permute", x, token, position, x.size(0));
    ctx->save_for_backward({position});
    return permute_forward_op().call(x, token);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {permute_backward_op().call(grads[0].contiguous(), saved[0]), at::Tensor(),
            at::Tensor()};
  }
};

class MoeUnpermuteFunction : public torch::autograd::Function<MoeUnpermuteFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& outputs,
                            const at::Tensor& weights, const at::Tensor& position) {
    const at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({outputs, weights, position});
    return unpermute_forward_op().call(outputs, weights, position);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_outputs, grad_weights] =
        unpermute_backward_op().call(grads[0].contiguous(), saved[0], saved[1], saved[2]);
    return {grad_outputs, grad_weights, at::Tensor()};
  }
};

at::Tensor moe_permute_autograd(const at::Tensor& x, const at::Tensor& token,
                                const at::Tensor& position) {
  return MoePermuteFunction::apply(x, token, position);
}

at::Tensor moe_permute_plain(const at::Tensor& x, const at::Tensor& token,
                             const at::Tensor& position) {
  detail::check_moe_indices("moe_permute", x, token, position, x.size(0));
  return permute_forward_op().call(x, token);
}

at::Tensor moe_unpermute_autograd(const at::Tensor& outputs, const at::Tensor& weights,
                                  const at::Tensor& position) {
  return MoeUnpermuteFunction::apply(outputs, weights, position);
}

at::Tensor moe_unpermute_plain(const at::Tensor& outputs, const at::Tensor& weights,
                               const at::Tensor& position) {
  return unpermute_forward_op().call(outputs, weights, position);
}

}  // namespace

MoeRouting moe_route_indices(const at::Tensor& chosen, int64_t num_experts, int64_t top_k,
                             int64_t capacity) {
  auto [order, token, position, counts, kept_counts] =
      route_op().call(chosen, num_experts, top_k, capacity);
  return {.order = std::move(order),
          .token = std::move(token),
          .position = std::move(position),
          .counts = std::move(counts),
          .kept_counts = std::move(kept_counts)};
}

at::Tensor moe_permute(const at::Tensor& x, const at::Tensor& token, const at::Tensor& position) {
  return permute_op().call(x, token, position);
}

at::Tensor moe_permute_forward(const at::Tensor& x, const at::Tensor& token) {
  return permute_forward_op().call(x, token);
}

at::Tensor moe_permute_backward(const at::Tensor& grad, const at::Tensor& position) {
  return permute_backward_op().call(grad, position);
}

at::Tensor moe_unpermute(const at::Tensor& outputs, const at::Tensor& weights,
                         const at::Tensor& position) {
  return unpermute_op().call(outputs, weights, position);
}

at::Tensor moe_unpermute_forward(const at::Tensor& outputs, const at::Tensor& weights,
                                 const at::Tensor& position) {
  return unpermute_forward_op().call(outputs, weights, position);
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward(const at::Tensor& grad,
                                                          const at::Tensor& outputs,
                                                          const at::Tensor& weights,
                                                          const at::Tensor& position) {
  return unpermute_backward_op().call(grad, outputs, weights, position);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def(
      "moe_route_indices(Tensor chosen, int num_experts, int top_k, int capacity) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_permute(Tensor x, Tensor token, Tensor position) -> Tensor");
  m.def("moe_permute_forward(Tensor x, Tensor token) -> Tensor");
  m.def("moe_permute_backward(Tensor grad, Tensor position) -> Tensor");
  m.def("moe_unpermute(Tensor outputs, Tensor weights, Tensor position) -> Tensor");
  m.def("moe_unpermute_forward(Tensor outputs, Tensor weights, Tensor position) -> Tensor");
  m.def(
      "moe_unpermute_backward(Tensor grad, Tensor outputs, Tensor weights, Tensor position) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) {
  m.impl("moe_route_indices", &d9d::kernels::moe_route_indices_cpu);
  m.impl("moe_permute_forward", &d9d::kernels::moe_permute_forward_cpu);
  m.impl("moe_permute_backward", &d9d::kernels::moe_permute_backward_cpu);
  m.impl("moe_unpermute_forward", &d9d::kernels::moe_unpermute_forward_cpu);
  m.impl("moe_unpermute_backward", &d9d::kernels::moe_unpermute_backward_cpu);
}

TORCH_LIBRARY_IMPL(d9d, Autograd, m) {
  m.impl("moe_permute", &d9d::kernels::moe_permute_autograd);
  m.impl("moe_unpermute", &d9d::kernels::moe_unpermute_autograd);
}

TORCH_LIBRARY_IMPL(d9d, CompositeExplicitAutograd, m) {
  m.impl("moe_permute", &d9d::kernels::moe_permute_plain);
  m.impl("moe_unpermute", &d9d::kernels::moe_unpermute_plain);
}
