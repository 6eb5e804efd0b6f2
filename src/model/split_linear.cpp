// d9d/model/split_linear.cpp — the split-capable linear layer, linear layers of one input as one
// node (fan_out_linear), the low-rank (LoRA) linear, the feed-forward's down projection that
// recomputes its input and the float8 linear: autograd functions whose backward queues the weight
// gradients on a deferring d9d::WeightGradQueue (d9d/core/weight_grad.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/init.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/detail/gradient_home.hpp>
#include <d9d/core/detail/weight_casts.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/kernels/float8.hpp>
#include <d9d/kernels/silu_mul.hpp>
#include <d9d/model/layers.hpp>

namespace d9d::model {
namespace {

// The weight (and bias) gradient of y = x W^T + b, accumulated into the parameters' .grad in their
// own dtype, as the autograd engine would.
void accumulate(at::Tensor& parameter, const at::Tensor& gradient) {
  auto& grad = parameter.mutable_grad();
  const auto converted = gradient.to(parameter.scalar_type());
  if (grad.defined()) {
    grad.add_(converted);
  } else {
    grad = converted.contiguous();
  }
}

using d9d::detail::autocast_dtype;

// `t` as at::linear would compute with it when `x` is its input: in autocast's dtype while autocast
// is on for x's device (and x is floating point), else as it is. The autograd functions below cast
// their inputs so, so that backward sees the tensors forward used. Undefined stays undefined.
at::Tensor autocast_like(const at::Tensor& t, const at::Tensor& x) {
  const auto dtype = autocast_dtype(x);
  // No dispatch when t has the dtype already (the norms write it: d9d/model/layers.hpp).
  return t.defined() && dtype && t.scalar_type() != *dtype ? t.to(*dtype) : t;
}

// A weight as autocast_like casts it, through the step's cast cache
// (d9d/core/detail/weight_casts.hpp): cast once per step, not once per microbatch, while the train
// step keeps a scope open.
at::Tensor autocast_weight(const at::Tensor& w, const at::Tensor& x) {
  const auto dtype = autocast_dtype(x);
  return dtype ? detail::cast_weight(w, *dtype) : w;
}

// grad_out @ W for grad_out's rows [rows, out] (the gradient `like` [..., out] flattened): one mm
// and a view, shaped like `like` with W's input features last (at::matmul dispatches a reshape, an
// mm and an unsafe view per call, and this runs for every linear layer of every microbatch).
at::Tensor rows_times(const at::Tensor& grad_rows, const at::Tensor& w, const at::Tensor& like) {
  auto sizes = like.sizes().vec();
  sizes.back() = w.size(1);
  return at::mm(grad_rows, w).view(sizes);
}

// The queue forward bound this node to (its address in saved_data["queue"]) while it defers, else
// null: backward then computes the weight gradients at once.
WeightGradQueue* deferring_queue(torch::autograd::AutogradContext* ctx) {
  // NOLINTNEXTLINE(performance-no-int-to-ptr): the queue's address, stored by forward()
  auto* queue = reinterpret_cast<WeightGradQueue*>(ctx->saved_data["queue"].toInt());
  return queue != nullptr && queue->deferring() ? queue : nullptr;
}

struct WeightGrad {
  at::Tensor grad_out;  // [rows, out]
  at::Tensor input;     // [rows, in]
  at::Tensor weight;    // the parameter (for .grad), when it needs a gradient
  at::Tensor bias;      // the parameter, when it needs a gradient

  // A float32 weight on CUDA whose product runs in bfloat16 or half (bf16 mixed precision): the
  // GEMM writes the float32 gradient itself (cuBLAS accumulates in float32 anyway), instead of a
  // rounded bfloat16 product that is then converted and added — one kernel, not three, per
  // linear layer and microbatch.
  [[nodiscard]] bool widening() const {
    const auto low = grad_out.scalar_type();
    return weight.defined() && weight.is_cuda() && weight.scalar_type() == at::kFloat &&
           (low == at::kBFloat16 || low == at::kHalf) && input.scalar_type() == low;
  }

  [[nodiscard]] std::pair<at::Tensor, at::Tensor> compute() const {
    at::Tensor gw;
    at::Tensor gb;
    if (weight.defined()) {
      gw = widening() ? at::mm(grad_out.t(), input, at::kFloat) : grad_out.t().mm(input);
    }
    if (bias.defined()) {
      gb = grad_out.sum(0);
    }
    return {gw, gb};
  }
  // Whether the weight's .grad can take the product in place: it exists, contiguous, in the dtype
  // the GEMM writes (float32 when widening, else the operands').
  [[nodiscard]] bool grad_takes_product() const {
    if (!weight.defined()) {
      return false;
    }
    const auto& grad = weight.grad();
    const auto product = widening() ? at::kFloat : grad_out.scalar_type();
    return grad.defined() && grad.is_contiguous() && grad.scalar_type() == product &&
           input.scalar_type() == grad_out.scalar_type() && grad.device() == grad_out.device();
  }

  // Where a backward that does not defer puts the weight's product.
  enum class Sink {
    // Returned: AccumulateGrad adds it to .grad (a read of two float32 gradients and a write of
    // one per weight and microbatch, in a kernel of its own).
    returned,
    // Added into .grad by the GEMM (beta = 1), nothing returned (6% of a tensor-parallel 1.7B
    // step on H200s): while nothing can tell the difference.
    in_place,
    // Added by the GEMM into .grad taken off the parameter, which is returned as the gradient:
    // AccumulateGrad finds no .grad and keeps the tensor it gets (no kernel, the same memory),
    // then calls the parameter's post-accumulate-grad hook (the data-parallel reducers' readiness)
    // once per backward, as for any gradient. A weight with other uses in the graph still sums
    // right: the engine adds their gradients to the returned one before AccumulateGrad.
    handed_back,
    // Written by the GEMM (beta = 0) into the memory the parameter's hook offers for its gradient
    // (d9d/core/detail/gradient_home.hpp: Replicate's copy buffer), which is returned: the step's
    // first product, where .grad is still undefined. AccumulateGrad keeps it as .grad, as for
    // handed_back, so later microbatches add into that memory and the reducer copies nothing.
    placed,
  };
  // The sink: in place only while the gradient exists to take the product, no hook waits on the
  // parameter, the backward accumulates into .grad (torch::autograd::backward of everything, not
  // autograd::grad of chosen inputs) and builds no graph of its own (create_graph); handed back
  // where the only hook is a post-accumulate-grad hook and .grad owns its tensor alone (another
  // owner would make AccumulateGrad copy it to new memory); placed, under the same conditions,
  // where .grad does not exist yet and the only hook is a GradientHome.
  [[nodiscard]] Sink sink() const {
    const bool first = weight.defined() && !weight.grad().defined();
    if (bias.defined() || !(first || grad_takes_product()) || at::GradMode::is_enabled()) {
      return Sink::returned;
    }
    // A hook on the gradient as it arrives (register_hook) would not see this one.
    if (const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(weight);
        accumulator != nullptr &&
        (!accumulator->tensor_pre_hooks().empty() || !accumulator->pre_hooks().empty() ||
         !accumulator->post_hooks().empty())) {
      return Sink::returned;
    }
    if (const auto* chosen = torch::autograd::get_current_graph_task_exec_info();
        chosen != nullptr && !chosen->empty()) {
      return Sink::returned;
    }
    if (first) {
      return d9d::detail::gradient_home_of(weight) != nullptr ? Sink::placed : Sink::returned;
    }
    if (torch::autograd::impl::post_acc_grad_hooks(weight) == nullptr) {
      return Sink::in_place;
    }
    return weight.grad().use_count() == 1 ? Sink::handed_back : Sink::returned;
  }

  // Sink::placed: the product written into the home the hook offers, if it offers one that takes
  // it (the parameter's sizes, contiguous, in the dtype the GEMM writes, on its device); else
  // undefined and nothing written.
  [[nodiscard]] at::Tensor place() const {
    auto home = d9d::detail::gradient_home_of(weight)->home();
    const auto product = widening() ? at::kFloat : grad_out.scalar_type();
    if (!home.defined() || !home.is_contiguous() || home.sizes() != weight.sizes() ||
        home.scalar_type() != product || home.device() != grad_out.device() ||
        input.scalar_type() != grad_out.scalar_type()) {
      return {};
    }
    if (widening()) {
      at::mm_out(home, grad_out.t(), input, at::kFloat);
    } else {
      at::mm_out(home, grad_out.t(), input);
    }
    return home;
  }

  // .grad += the product, in the GEMM (widening: cuBLAS writes float32 from bfloat16 inputs).
  void add_product(at::Tensor& grad) const {
    if (widening()) {
      at::addmm_out(grad, grad, grad_out.t(), input, at::kFloat);
    } else {
      grad.addmm_(grad_out.t(), input);
    }
  }

  // Sink::handed_back: .grad taken off the parameter with the product added, to be returned.
  at::Tensor hand_back() {
    at::Tensor grad = std::move(weight.mutable_grad());  // .grad left undefined
    add_product(grad);
    return grad;
  }

  void run() {
    if (grad_takes_product()) {
      add_product(weight.mutable_grad());
      if (bias.defined()) {
        accumulate(bias, grad_out.sum(0));
      }
      return;
    }
    auto [gw, gb] = compute();
    if (weight.defined()) {
      accumulate(weight, gw);
    }
    if (bias.defined()) {
      accumulate(bias, gb);
    }
  }

  // The weight's gradient for a backward that does not defer: the product through its sink
  // (undefined where the GEMM added it in place).
  at::Tensor weight_gradient() {
    switch (sink()) {
      case Sink::in_place:
        run();
        return {};
      case Sink::handed_back:
        return hand_back();
      case Sink::placed:
        if (auto placed = place(); placed.defined()) {
          return placed;
        }
        break;
      case Sink::returned:
        break;
    }
    return compute().first;
  }
};

// Weight gradients of one backward, each with the index of its forward argument: pushed as one job
// while the node's queue defers (W), else computed into `out` at those indices.
using WeightGradJobs = std::vector<std::pair<size_t, WeightGrad>>;
void queue_or_compute(torch::autograd::AutogradContext* ctx, WeightGradJobs jobs,
                      torch::autograd::variable_list& out) {
  if (auto* queue = deferring_queue(ctx); queue != nullptr && !jobs.empty()) {
    queue->push([jobs = std::move(jobs)]() mutable {
      for (auto& job : jobs) {
        job.second.run();
      }
    });
    return;
  }
  for (auto& [index, job] : jobs) {
    out[index] = job.weight_gradient();
  }
}

// y = x W^T (+ b) whose backward can queue the weight-gradient GEMM (see d9d/core/weight_grad.hpp).
// Two variants, because every tensor argument of an autograd function must be defined.
template <bool HasBias>
struct SplitLinear : torch::autograd::Function<SplitLinear<HasBias>> {
  static at::Tensor run_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                const at::Tensor& weight, const at::Tensor& bias,
                                int64_t queue_address) {
    const auto xc = autocast_like(x, x);
    const auto wc = autocast_weight(weight, x);
    const auto bc = autocast_weight(bias, x);
    ctx->save_for_backward({xc, wc});
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["weight"] = weight;
    if (bias.defined()) {
      ctx->saved_data["bias"] = bias;
    }
    return at::linear(xc, wc, bc);
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            int64_t queue_address) requires HasBias {
    return run_forward(ctx, x, weight, bias, queue_address);
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, int64_t queue_address) requires(!HasBias) {
    return run_forward(ctx, x, weight, at::Tensor(), queue_address);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const auto& wc = saved[1];
    const auto& grad_out = grads[0];
    // One entry per forward argument: x, weight, (bias,) queue address.
    torch::autograd::variable_list out(HasBias ? 4 : 3);
    const int64_t out_features = wc.size(0);
    const int64_t in_features = wc.size(1);
    const auto grad_rows = grad_out.reshape({-1, out_features});
    if (ctx->needs_input_grad(0)) {
      out[0] = rows_times(grad_rows, wc, grad_out);
    }
    const bool need_w = ctx->needs_input_grad(1);
    const bool need_b = HasBias && ctx->needs_input_grad(2);
    if (!need_w && !need_b) {
      return out;
    }
    WeightGrad job{.grad_out = grad_rows,
                   .input = xc.reshape({-1, in_features}),
                   .weight = need_w ? ctx->saved_data["weight"].toTensor() : at::Tensor(),
                   .bias = need_b ? ctx->saved_data["bias"].toTensor() : at::Tensor()};
    if (auto* queue = deferring_queue(ctx); queue != nullptr) {
      queue->push([job = std::move(job)]() mutable { job.run(); });
      return out;
    }
    if (!HasBias || !need_b) {
      out[1] = job.weight_gradient();
      return out;
    }
    auto [gw, gb] = job.compute();
    out[1] = gw;
    if (HasBias) {
      out[2] = gb;
    }
    return out;
  }
};

// The backward of a fan-out of linear layers (FanOutLinear, GatheredFanOutLinear), whose saved
// variables are the input first and then each layer's weight as the GEMMs used it (the parameters
// in saved_data["weights"]): each output's gradient as rows [tokens, out_i] (undefined where none
// came), x's gradient rows and the weight-gradient jobs.
class FanOutGrads {
 public:
  // `grads`: the backward's, one per layer.
  FanOutGrads(torch::autograd::variable_list grads, const torch::autograd::variable_list& saved)
      : saved_(saved) {
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) {
        grads[i] = grads[i].reshape({-1, saved[i + 1].size(0)});
      }
    }
    rows_ = std::move(grads);
  }
  [[nodiscard]] size_t layers() const { return rows_.size(); }
  // sum_i g_i W_i in one chain of GEMMs (g_1 W_1, then + g_i W_i accumulated by the next GEMM);
  // undefined when no output had a gradient.
  [[nodiscard]] at::Tensor input_rows() const {
    at::Tensor dx;
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (rows_[i].defined()) {
        dx = dx.defined() ? dx.addmm_(rows_[i], saved_[i + 1]) : at::mm(rows_[i], saved_[i + 1]);
      }
    }
    return dx;
  }
  // The weight gradients g_i^T `input` of the weights that train, at their forward arguments.
  [[nodiscard]] WeightGradJobs weight_jobs(torch::autograd::AutogradContext* ctx,
                                           const at::Tensor& input) const {
    const auto weights = ctx->saved_data["weights"].toTensorVector();
    WeightGradJobs jobs;
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (rows_[i].defined() && ctx->needs_input_grad(i + 1)) {
        jobs.emplace_back(
            i + 1,
            WeightGrad{
                .grad_out = rows_[i], .input = input, .weight = weights[i], .bias = at::Tensor()});
      }
    }
    return jobs;
  }

 private:
  const torch::autograd::variable_list& saved_;
  std::vector<at::Tensor> rows_;
};

// y_i = x W_i^T for linear layers reading one x (fan_out_linear): one node instead of one per
// layer, whose backward sums x's gradient in a chain of GEMMs (each adding into the previous
// product) instead of the engine adding the layers' input gradients, and pushes every weight
// gradient as one job. Saves the autocast copy of x once and each layer's cast weight.
struct FanOutLinear : torch::autograd::Function<FanOutLinear> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, at::TensorList weights,
                                                int64_t queue_address) {
    ctx->set_materialize_grads(false);  // an output without a gradient adds nothing
    const auto xc = autocast_like(x, x);
    const auto rows = xc.reshape({-1, xc.size(-1)});
    torch::autograd::variable_list saved{xc};
    torch::autograd::variable_list outputs;
    auto sizes = xc.sizes().vec();
    for (const auto& weight : weights) {
      const auto wc = autocast_weight(weight, x);
      TORCH_CHECK(wc.dim() == 2 && wc.size(1) == xc.size(-1), "d9d::model::fan_out_linear: x has ",
                  xc.size(-1), " features, a weight is ", wc.sizes());
      sizes.back() = wc.size(0);
      // Not a view of the product (as at::linear's output): callers may write into it.
      outputs.push_back(at::_unsafe_view(at::mm(rows, wc.t()), sizes));
      saved.push_back(wc);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["weights"] = weights.vec();
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const FanOutGrads fan(std::move(grads), saved);
    // One entry per forward argument: x, each weight, the queue address.
    torch::autograd::variable_list out(fan.layers() + 2);
    if (ctx->needs_input_grad(0)) {
      if (const auto dx = fan.input_rows(); dx.defined()) {
        out[0] = dx.view(xc.sizes());
      }
    }
    auto jobs = fan.weight_jobs(ctx, xc.reshape({-1, xc.size(-1)}));
    queue_or_compute(ctx, std::move(jobs), out);
    return out;
  }
};

// The rows of `all` [R n, k] other than this rank's [rank n, (rank + 1) n) times `m` [k, j], into
// the same rows of `out` [R n, j] (this rank's were multiplied while `all` was being gathered).
void others_times(const at::Tensor& all, const at::Tensor& m, const at::Tensor& out, int64_t rank,
                  int64_t n) {
  const int64_t ranks = all.size(0) / n;
  if (rank > 0) {
    auto before = out.narrow(0, 0, rank * n);
    at::mm_out(before, all.narrow(0, 0, rank * n), m);
  }
  if (rank + 1 < ranks) {
    const int64_t count = (ranks - rank - 1) * n;
    auto after = out.narrow(0, (rank + 1) * n, count);
    at::mm_out(after, all.narrow(0, (rank + 1) * n, count), m);
  }
}

// fan_out_linear of the tokens that sequence parallelism's copy_in would gather, overlapping the
// collectives with the GEMMs (fan_out_linear_gathered). x is this rank's shard [B, T / R, H] of
// the microbatch's tokens, rows [r n, (r + 1) n) of the B T = R n (TensorParallelGroup::copy_in):
// forward multiplies those rows while the others are gathered, then the others; backward starts
// the input gradient's reduce-scatter as soon as its sum is computed and runs the weight GEMMs
// (or queues them) before waiting for it.
struct GatheredFanOutLinear : torch::autograd::Function<GatheredFanOutLinear> {
  static const TensorParallelGroup& group_of(int64_t address) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the group outlives the layer's graphs
    return *reinterpret_cast<const TensorParallelGroup*>(address);
  }
  // The inverse: the group's address, carried through the autograd context.
  static int64_t address_of(const TensorParallelGroup& group) {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): carried through the context
    return static_cast<int64_t>(reinterpret_cast<std::intptr_t>(&group));
  }

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, at::TensorList weights,
                                                int64_t group_address, int64_t queue_address) {
    ctx->set_materialize_grads(false);  // an output without a gradient adds nothing
    const auto& group = group_of(group_address);
    const int64_t ranks = group.size();
    const int64_t rank = group.rank();
    const auto xc = autocast_like(x, x);
    const auto mine = xc.reshape({-1, xc.size(-1)});
    const int64_t n = mine.size(0);
    auto pending = group.start_gather_tokens(mine);
    std::vector<at::Tensor> wcs;
    std::vector<at::Tensor> rows_out;
    for (const auto& weight : weights) {
      auto wc = autocast_weight(weight, x);
      TORCH_CHECK(wc.dim() == 2 && wc.size(1) == xc.size(-1),
                  "d9d::model::fan_out_linear_gathered: x has ", xc.size(-1), " features, a ",
                  "weight is ", wc.sizes());
      auto out = at::empty({ranks * n, wc.size(0)}, mine.options());
      auto own = out.narrow(0, rank * n, n);
      at::mm_out(own, mine, wc.t());  // while the others arrive
      rows_out.push_back(std::move(out));
      wcs.push_back(std::move(wc));
    }
    const auto all = pending->wait();  // [R n, H]
    for (size_t i = 0; i < wcs.size(); ++i) {
      others_times(all, wcs[i].t(), rows_out[i], rank, n);
    }
    torch::autograd::variable_list saved{all};
    torch::autograd::variable_list outputs;
    for (size_t i = 0; i < wcs.size(); ++i) {
      // [B, R T', out_i]: the microbatch's B T tokens, sequence after sequence.
      outputs.push_back(rows_out[i].view({xc.size(0), -1, wcs[i].size(0)}));
      saved.push_back(wcs[i]);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["group"] = group_address;
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["weights"] = weights.vec();
    ctx->saved_data["shard"] = xc.sizes().vec();
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const FanOutGrads fan(std::move(grads), saved);
    // One entry per forward argument: x, each weight, the group and queue addresses.
    torch::autograd::variable_list out(fan.layers() + 3);
    std::unique_ptr<PendingTokens> pending;
    if (ctx->needs_input_grad(0)) {
      if (const auto dx = fan.input_rows(); dx.defined()) {
        pending = group_of(ctx->saved_data["group"].toInt()).start_scatter_tokens(dx, {});
      }
    }
    auto jobs = fan.weight_jobs(ctx, saved[0]);   // saved[0]: the gathered input rows
    queue_or_compute(ctx, std::move(jobs), out);  // while the reduce-scatter runs
    if (pending) {
      out[0] = pending->wait().view(ctx->saved_data["shard"].toIntVector());
    }
    return out;
  }
};

// reduce_out(h W^T) under sequence parallelism for a row-parallel projection
// (linear_scattered, silu_mul_linear_scattered): h [B, T, in] holds the microbatch's B T = R n
// tokens; or, when `gated`, h is the feed-forward's gate and the input is silu(gate) * up, which
// backward recomputes instead of keeping (as SiluMulLinear; otherwise `up` is h again, unused:
// every tensor argument of an autograd function must be defined). Forward computes
// the partial output in parts of every rank's rows and starts each part's reduce-scatter as soon
// as it is computed, so each runs during the next part's GEMMs; this rank's shard [n, out] (rows
// [r n, (r + 1) n), as copy_in takes it) is written in place by the parts. Backward starts
// gathering the output gradient's shards, meanwhile multiplies this rank's own rows for the input
// gradient, then the others' and the weight gradient (or queues it).
struct ScatteredLinear : torch::autograd::Function<ScatteredLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                            const at::Tensor& up, const at::Tensor& weight, bool gated,
                            int64_t group_address, int64_t queue_address) {
    const auto& group = GatheredFanOutLinear::group_of(group_address);
    const int64_t ranks = group.size();
    // gate and up come from linear layers, so they already have the autocast dtype.
    const auto hc = gated ? kernels::silu_mul_forward(h, up) : autocast_like(h, h);
    const auto wc = autocast_weight(weight, hc);
    TORCH_CHECK(wc.dim() == 2 && wc.size(1) == hc.size(-1), "d9d::model::linear_scattered: h has ",
                hc.size(-1), " features, the weight is ", wc.sizes());
    const auto rows = hc.reshape({-1, hc.size(-1)});
    const int64_t n = rows.size(0) / ranks;
    // Two parts when the rows split evenly (four measured slower on H200s at 1.7B).
    const int64_t parts = n % 2 == 0 && n >= 2 ? 2 : 1;
    const int64_t m = n / parts;
    auto out = at::empty({n, wc.size(0)}, rows.options());
    std::vector<std::unique_ptr<PendingTokens>> pending;
    for (int64_t k = 0; k < parts; ++k) {
      // Part k of every rank's rows, rank after rank: [R m, out].
      auto part = at::empty({ranks * m, wc.size(0)}, rows.options());
      for (int64_t r = 0; r < ranks; ++r) {
        auto slot = part.narrow(0, r * m, m);
        at::mm_out(slot, rows.narrow(0, r * n + k * m, m), wc.t());
      }
      pending.push_back(group.start_scatter_tokens(part, out.narrow(0, k * m, m)));
    }
    for (auto& collective : pending) {
      (void)collective->wait();
    }
    if (gated) {
      ctx->save_for_backward({h, up, wc});
    } else {
      ctx->save_for_backward({rows, wc});
    }
    ctx->saved_data["group"] = group_address;
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["input"] = hc.sizes().vec();
    return out.view({hc.size(0), -1, wc.size(0)});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool gated = saved.size() == 3;
    const auto& wc = saved.back();
    const auto& group = GatheredFanOutLinear::group_of(ctx->saved_data["group"].toInt());
    const int64_t ranks = group.size();
    const int64_t rank = group.rank();
    // One entry per forward argument: h (the gate), up, the weight, gated, the group and queue
    // addresses.
    torch::autograd::variable_list out(6);
    const auto mine = grads[0].reshape({-1, wc.size(0)}).to(wc.scalar_type());
    const int64_t n = mine.size(0);
    auto pending = group.start_gather_tokens(mine);
    const bool need_input = ctx->needs_input_grad(0) || (gated && ctx->needs_input_grad(1));
    at::Tensor dh;
    if (need_input) {
      dh = at::empty({ranks * n, wc.size(1)}, mine.options());
      auto own = dh.narrow(0, rank * n, n);
      at::mm_out(own, mine, wc);  // while the others arrive
    }
    const auto all = pending->wait();  // [R n, out]
    const auto input_sizes = ctx->saved_data["input"].toIntVector();
    if (dh.defined()) {
      others_times(all, wc, dh, rank, n);
      if (gated) {
        auto [grad_gate, grad_up] =
            kernels::silu_mul_backward(dh.view(input_sizes), saved[0], saved[1]);
        out[0] = grad_gate;
        out[1] = grad_up;
      } else {
        out[0] = dh.view(input_sizes);
      }
    }
    WeightGradJobs jobs;
    if (ctx->needs_input_grad(2)) {
      const auto rows = gated ? kernels::silu_mul_forward(saved[0], saved[1])
                                    .reshape({-1, static_cast<int64_t>(input_sizes.back())})
                              : saved[0];
      jobs.emplace_back(2, WeightGrad{.grad_out = all,
                                      .input = rows,
                                      .weight = ctx->saved_data["weight"].toTensor(),
                                      .bias = at::Tensor()});
    }
    queue_or_compute(ctx, std::move(jobs), out);
    return out;
  }
};

// y = silu(gate) * up @ W^T without keeping h = silu(gate) * up for backward: it saves gate and up
// (which silu_mul's backward reads anyway) and recomputes h for the weight gradient. Saves the
// [tokens, intermediate] activation of every feed-forward layer (2.75 GiB for Qwen3-0.6B at
// 8 x 2048 tokens in bfloat16) for one more silu_mul pass in backward. Splits its backward like
// SplitLinear under a deferring queue.
struct SiluMulLinear : torch::autograd::Function<SiluMulLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& weight, int64_t queue_address) {
    const auto wc = autocast_weight(weight, gate);
    // gate and up come from linear layers, so they already have the autocast dtype.
    ctx->save_for_backward({gate, up, wc});
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["weight"] = weight;
    return at::linear(kernels::silu_mul_forward(gate, up), wc);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& gate = saved[0];
    const auto& up = saved[1];
    const auto& wc = saved[2];
    const auto& grad_out = grads[0];
    torch::autograd::variable_list out(4);  // gate, up, weight, queue address
    const int64_t out_features = wc.size(0);
    const int64_t in_features = wc.size(1);
    const auto grad_rows = grad_out.reshape({-1, out_features});
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) {
      const auto grad_h = rows_times(grad_rows, wc, grad_out);
      auto [grad_gate, grad_up] = kernels::silu_mul_backward(grad_h, gate, up);
      out[0] = grad_gate;
      out[1] = grad_up;
    }
    if (!ctx->needs_input_grad(2)) {
      return out;
    }
    WeightGradJobs jobs;
    jobs.emplace_back(
        2, WeightGrad{.grad_out = grad_rows,
                      .input = kernels::silu_mul_forward(gate, up).reshape({-1, in_features}),
                      .weight = ctx->saved_data["weight"].toTensor(),
                      .bias = at::Tensor()});
    queue_or_compute(ctx, std::move(jobs), out);
    return out;
  }
};

// The low-rank update's GEMMs, shared by LowRankLinear and SiluMulLowRankLinear: each saves the
// autocast copies of W, A and B and h = s x A^T [rows, rank] after its own inputs, and keeps the
// parameters (weight, a, b) and the scale in saved_data.
namespace low_rank {

// s a b: the GEMM scales its product (alpha) and reads nothing else (beta 0), so no elementwise
// pass multiplies the thin [n, rank] result.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, double scale) {
  auto out = at::empty({a.size(0), b.size(1)}, a.options());
  at::addmm_out(out, out, a, b, /*beta=*/0, /*alpha=*/scale);
  return out;
}

// thin + big: the rank-wide product first (memory-bound: it writes [n, out] once), then the big
// GEMM adds itself into it (beta 1), reading it in its epilogue while its own math bounds it,
// instead of a second memory-bound pass reading and writing the big product again.
at::Tensor thin_then_big(const at::Tensor& thin_a, const at::Tensor& thin_b,
                         const at::Tensor& big_a, const at::Tensor& big_b) {
  auto out = at::mm(thin_a, thin_b);
  out.addmm_(big_a, big_b);
  return out;
}

// y = x W^T + h B^T and h = s x A^T over rows [n, in].
std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& rows, const at::Tensor& wc,
                                          const at::Tensor& ac, const at::Tensor& bc,
                                          double scale) {
  auto h = scaled_mm(rows, ac.t(), scale);
  auto y = thin_then_big(h, bc.t(), rows, wc.t());
  return {std::move(y), std::move(h)};
}

// The weight gradient of `parameter` as a Linear's of its own (input, output), no bias.
WeightGrad weight_job(const at::Tensor& grad_out, const at::Tensor& input,
                      const at::Tensor& parameter) {
  return WeightGrad{
      .grad_out = grad_out, .input = input, .weight = parameter, .bias = at::Tensor()};
}

void save(torch::autograd::AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& a,
          const at::Tensor& b, double scale, int64_t queue_address) {
  ctx->saved_data["queue"] = queue_address;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["weight"] = weight;
  ctx->saved_data["a"] = a;
  ctx->saved_data["b"] = b;
}

// Backward from g [n, out]. `first` is the forward argument index of the weight (a and b follow
// it); `rows` makes the input rows [n, in], called only when W or A trains.
struct Backward {
  torch::autograd::AutogradContext* ctx;
  at::Tensor g;
  at::Tensor wc;
  at::Tensor ac;
  at::Tensor bc;
  at::Tensor h;
  size_t first;
  bool need_x;
  at::Tensor dh;  // the gradient of x A^T: s g B, when x's or A's gradient is needed

  Backward(torch::autograd::AutogradContext* context, at::Tensor grad, at::Tensor w, at::Tensor a,
           at::Tensor b, at::Tensor low, size_t weight_index, bool input_needed)
      : ctx(context),
        g(std::move(grad)),
        wc(std::move(w)),
        ac(std::move(a)),
        bc(std::move(b)),
        h(std::move(low)),
        first(weight_index),
        need_x(input_needed) {
    if (need_x || ctx->needs_input_grad(first + 1)) {
      dh = scaled_mm(g, bc, ctx->saved_data["scale"].toDouble());
    }
  }

  // dx = g W + dh A [n, in]; undefined unless x's gradient is needed.
  [[nodiscard]] at::Tensor input_grad() const {
    if (!need_x) {
      return {};
    }
    return thin_then_big(dh, ac, g, wc);
  }

  // W's, A's and B's gradients, each as Linear's weight gradient of its own (input, output), at
  // once or queued under a deferring queue.
  template <class Rows>
  void weights(Rows&& rows, torch::autograd::variable_list& out) const {
    const bool need_w = ctx->needs_input_grad(first);
    const bool need_a = ctx->needs_input_grad(first + 1);
    WeightGradJobs jobs;
    if (need_w || need_a) {
      const at::Tensor x = std::forward<Rows>(rows)();
      if (need_w) {
        jobs.emplace_back(first, job(g, x, "weight"));
      }
      if (need_a) {
        jobs.emplace_back(first + 1, job(dh, x, "a"));
      }
    }
    if (ctx->needs_input_grad(first + 2)) {
      jobs.emplace_back(first + 2, job(g, h, "b"));
    }
    queue_or_compute(ctx, std::move(jobs), out);
  }

 private:
  [[nodiscard]] WeightGrad job(const at::Tensor& grad_out, const at::Tensor& input,
                               const char* parameter) const {
    return weight_job(grad_out, input, ctx->saved_data[parameter].toTensor());
  }
};

}  // namespace low_rank

// x W^T + s (x A^T) B^T (layers.hpp, low_rank_linear). Saves the autocast copies of x, W, A and B
// and h = s x A^T [rows, rank]; the weights' gradients are W's (when it trains), A's = dh^T x with
// dh = s g B, and B's = g^T h, split off under a deferring queue.
struct LowRankLinear : torch::autograd::Function<LowRankLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b,
                            double scale, int64_t queue_address) {
    const auto xc = autocast_like(x, x);
    const auto wc = autocast_weight(weight, x);
    const auto ac = autocast_weight(a, x);
    const auto bc = autocast_weight(b, x);
    auto [y, h] = low_rank::forward(xc.reshape({-1, wc.size(1)}), wc, ac, bc, scale);
    ctx->save_for_backward({xc, wc, ac, bc, h});
    low_rank::save(ctx, weight, a, b, scale, queue_address);
    auto sizes = xc.sizes().vec();
    sizes.back() = wc.size(0);
    return y.view(sizes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const auto& wc = saved[1];
    const auto g = grads[0].reshape({-1, wc.size(0)});
    // One entry per forward argument: x, weight, a, b, scale, queue address.
    torch::autograd::variable_list out(6);
    const low_rank::Backward back(ctx, g, wc, saved[2], saved[3], saved[4], /*weight_index=*/1,
                                  ctx->needs_input_grad(0));
    if (const auto dx = back.input_grad(); dx.defined()) {
      out[0] = dx.view(xc.sizes());
    }
    back.weights([&] { return xc.reshape({-1, wc.size(1)}); }, out);
    return out;
  }
};

// y_i = x W_i^T + s (x A_i^T) B_i^T for linear layers that read one x, each with a low-rank
// adapter of the same scale (fan_out_linear: q, k and v; gate and up): the adapters' A factors
// stacked, so x is read once for all their products h = s x [A_1; ...; A_k]^T, and x's gradient is
// one chain of GEMMs — the stacked dh [A_1; ...; A_k] first, each g_i W_i added into it — instead
// of one node per layer whose input gradients the engine adds. Saves x's autocast copy, h [rows,
// ranks summed] and each layer's cast A, W and B (what low_rank_linear saves): backward stacks the
// A factors again (a [ranks, in] copy) rather than keeping the stack.
struct LowRankFanOutLinear : torch::autograd::Function<LowRankFanOutLinear> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, at::TensorList weights,
                                                at::TensorList as, at::TensorList bs, double scale,
                                                int64_t queue_address) {
    ctx->set_materialize_grads(false);  // an output without a gradient adds nothing
    const auto xc = autocast_like(x, x);
    const auto rows = xc.reshape({-1, xc.size(-1)});
    std::vector<at::Tensor> factors;
    std::vector<int64_t> ranks;
    for (const auto& a : as) {
      factors.push_back(autocast_weight(a, x));
      ranks.push_back(a.size(0));
    }
    const auto h = low_rank::scaled_mm(rows, at::cat(factors).t(), scale);  // [rows, ranks summed]
    torch::autograd::variable_list saved{xc, h};
    saved.insert(saved.end(), factors.begin(), factors.end());
    torch::autograd::variable_list outputs;
    auto sizes = xc.sizes().vec();
    int64_t column = 0;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      const auto wc = autocast_weight(weights[i], x);
      const auto bc = autocast_weight(bs[i], x);
      TORCH_CHECK(wc.dim() == 2 && wc.size(1) == xc.size(-1) && bc.size(0) == wc.size(0) &&
                      bc.size(1) == ranks[i],
                  "d9d::model::fan_out_linear: x has ", xc.size(-1), " features, a weight is ",
                  wc.sizes(), " with lora_B ", bc.sizes());
      sizes.back() = wc.size(0);
      outputs.push_back(at::_unsafe_view(
          low_rank::thin_then_big(h.narrow(1, column, ranks[i]), bc.t(), rows, wc.t()), sizes));
      saved.push_back(wc);
      saved.push_back(bc);
      column += ranks[i];
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["weights"] = weights.vec();
    ctx->saved_data["as"] = as.vec();
    ctx->saved_data["bs"] = bs.vec();
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const auto& h = saved[1];
    const auto ranks = ctx->saved_data["ranks"].toIntVector();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto k = ranks.size();
    const auto factors = at::TensorList(saved).slice(2, k);
    const auto rows = xc.reshape({-1, xc.size(-1)});
    // One entry per forward argument: x, each weight, each A, each B, the scale, the queue.
    torch::autograd::variable_list out(1 + 3 * k + 2);
    std::vector<at::Tensor> g(k);
    for (std::size_t i = 0; i < k; ++i) {
      if (grads[i].defined()) {
        g[i] = grads[i].reshape({-1, grads[i].size(-1)});
      }
    }
    const auto wc = [&](std::size_t i) -> const at::Tensor& { return saved[2 + k + 2 * i]; };
    const auto bc = [&](std::size_t i) -> const at::Tensor& { return saved[3 + k + 2 * i]; };
    const bool need_x = ctx->needs_input_grad(0);
    bool need_a = false;
    for (std::size_t i = 0; i < k; ++i) {
      need_a = need_a || ctx->needs_input_grad(1 + k + i);
    }
    // dh: each layer's s g_i B_i in its columns (zero where its output has no gradient).
    at::Tensor dh;
    if (need_x || need_a) {
      dh = at::empty({rows.size(0), h.size(1)}, rows.options());
      int64_t column = 0;
      for (std::size_t i = 0; i < k; ++i) {
        auto part = dh.narrow(1, column, ranks[i]);
        if (g[i].defined()) {
          at::addmm_out(part, part, g[i], bc(i), /*beta=*/0, /*alpha=*/scale);
        } else {
          part.zero_();
        }
        column += ranks[i];
      }
    }
    if (need_x) {
      auto dx = at::mm(dh, at::cat(factors));
      for (std::size_t i = 0; i < k; ++i) {
        if (g[i].defined()) {
          dx.addmm_(g[i], wc(i));
        }
      }
      out[0] = dx.view(xc.sizes());
    }
    const auto weights = ctx->saved_data["weights"].toTensorVector();
    const auto as = ctx->saved_data["as"].toTensorVector();
    const auto bs = ctx->saved_data["bs"].toTensorVector();
    WeightGradJobs jobs;
    int64_t column = 0;
    for (std::size_t i = 0; i < k; ++i) {
      if (g[i].defined()) {
        if (ctx->needs_input_grad(1 + i)) {
          jobs.emplace_back(1 + i, low_rank::weight_job(g[i], rows, weights[i]));
        }
        if (ctx->needs_input_grad(1 + k + i)) {
          jobs.emplace_back(1 + k + i,
                            low_rank::weight_job(dh.narrow(1, column, ranks[i]), rows, as[i]));
        }
        if (ctx->needs_input_grad(1 + 2 * k + i)) {
          jobs.emplace_back(1 + 2 * k + i,
                            low_rank::weight_job(g[i], h.narrow(1, column, ranks[i]), bs[i]));
        }
      }
      column += ranks[i];
    }
    queue_or_compute(ctx, std::move(jobs), out);
    return out;
  }
};

// down(x) + s (x A^T) B^T with x = silu(gate) * up, for a down projection with a LoRA adapter:
// LowRankLinear's GEMMs over the product, which backward recomputes from gate and up (as
// SiluMulLinear) instead of keeping it. Saves gate, up, the autocast copies of W, A and B and
// h = s x A^T [rows, rank].
struct SiluMulLowRankLinear : torch::autograd::Function<SiluMulLowRankLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& weight, const at::Tensor& a,
                            const at::Tensor& b, double scale, int64_t queue_address) {
    // gate and up come from linear layers, so they already have the autocast dtype.
    const auto wc = autocast_weight(weight, gate);
    const auto ac = autocast_weight(a, gate);
    const auto bc = autocast_weight(b, gate);
    auto [y, h] = low_rank::forward(kernels::silu_mul_forward(gate, up).reshape({-1, wc.size(1)}),
                                    wc, ac, bc, scale);
    ctx->save_for_backward({gate, up, wc, ac, bc, h});
    low_rank::save(ctx, weight, a, b, scale, queue_address);
    auto sizes = gate.sizes().vec();
    sizes.back() = wc.size(0);
    return y.view(sizes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& gate = saved[0];
    const auto& up = saved[1];
    const auto& wc = saved[2];
    const auto g = grads[0].reshape({-1, wc.size(0)});
    // One entry per forward argument: gate, up, weight, a, b, scale, queue address.
    torch::autograd::variable_list out(7);
    const low_rank::Backward back(ctx, g, wc, saved[3], saved[4], saved[5], /*weight_index=*/2,
                                  ctx->needs_input_grad(0) || ctx->needs_input_grad(1));
    if (const auto dx = back.input_grad(); dx.defined()) {
      auto [grad_gate, grad_up] = kernels::silu_mul_backward(dx.view(gate.sizes()), gate, up);
      out[0] = grad_gate;
      out[1] = grad_up;
    }
    back.weights(
        [&] {
          return kernels::silu_mul_forward(gate, up).reshape({-1, wc.size(1)});
        },
        out);
    return out;
  }
};

// The last input a float8 layer quantised on this thread, in both forms: the q, k and v projections
// (the gate and up projections) read one input, which is then quantised once for all of them.
// The cache holds the input detached (its values, not its autograd graph), which keeps its storage
// alive: the same storage, layout and version counter then mean the same values (no other tensor
// can take a freed storage's address meanwhile, and writes through autograd-visible tensors move
// the counter).
struct Float8InputCache {
  at::Tensor input;  // detached
  int64_t version = 0;
  bool rowwise = true;
  at::ScalarType dtype = at::kFloat;  // of the quantised values (autocast's)
  kernels::Float8Tensor rows;
  kernels::Float8Tensor columns;  // undefined until a layer that trains asks
};

// The input's quantised rows and, when `columns`, its quantised columns, from the cache or made.
std::pair<kernels::Float8Tensor, kernels::Float8Tensor> quantized_input(const at::Tensor& x,
                                                                        const at::Tensor& xc,
                                                                        bool rowwise,
                                                                        bool columns) {
  thread_local Float8InputCache cache;
  const bool same =
      cache.input.defined() && x.has_storage() &&
      cache.input.storage().unsafeGetStorageImpl() == x.storage().unsafeGetStorageImpl() &&
      cache.input.storage_offset() == x.storage_offset() && cache.input.sizes() == x.sizes() &&
      cache.input.strides() == x.strides() && cache.input.scalar_type() == x.scalar_type() &&
      x._version() == cache.version && cache.rowwise == rowwise && cache.dtype == xc.scalar_type();
  const auto rows = xc.reshape({-1, xc.size(-1)});
  if (!same) {
    cache = Float8InputCache{.input = x.detach(),
                             .version = x._version(),
                             .rowwise = rowwise,
                             .dtype = xc.scalar_type(),
                             .rows = {},
                             .columns = {}};
    if (columns) {
      std::tie(cache.rows, cache.columns) =
          kernels::float8_quantize_both(rows, at::kFloat8_e4m3fn, rowwise);
    } else {
      cache.rows = kernels::float8_quantize(rows, at::kFloat8_e4m3fn, rowwise);
    }
  }
  if (columns && !cache.columns.data.defined()) {
    cache.columns = kernels::float8_quantize(rows, at::kFloat8_e4m3fn, rowwise, /*transpose=*/true);
  }
  return {cache.rows, columns ? cache.columns : kernels::Float8Tensor{}};
}

// W's float8 bytes transposed for dx = g W. A weight FullyShard gathered as float8 (`gathered_how`:
// the layer's settings when the forward read Float8Linear::weight, else 0) stays the same until
// FullyShard gathers or frees its unit again, which drops Float8Linear::weight_transposed: the
// step's first backward transposes it and its later microbatches reuse that.
kernels::Float8Tensor transposed_weight(const kernels::Float8Tensor& w, bool rowwise,
                                        int64_t gathered_how) {
  if (gathered_how == 0) {
    return kernels::float8_transpose(w, /*unit_scales=*/rowwise);
  }
  // NOLINTNEXTLINE(performance-no-int-to-ptr): the layer's settings, passed by address
  const auto& how = *reinterpret_cast<const Float8Linear*>(gathered_how);
  if (!how.weight_transposed.data.defined()) {
    how.weight_transposed = kernels::float8_transpose(w, /*unit_scales=*/rowwise);
  }
  return how.weight_transposed;
}

// y = x W^T with its three GEMMs in float8 (layers.hpp, float8_linear). Saves the float8 weight
// (rows) and, when W trains, x^T quantised along the tokens — what the weight gradient multiplies —
// instead of x. The float8 weight of a FullyShard float8 gather lives on its unit's storage, which
// is gathered again before this layer's backward, so saving it holds no extra memory.
struct Float8LinearFunction : torch::autograd::Function<Float8LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, int64_t how_address, bool weight_trains,
                            int64_t queue_address) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the layer's settings, passed by address
    const auto& how = *reinterpret_cast<const Float8Linear*>(how_address);
    const auto e4m3 = at::kFloat8_e4m3fn;
    const auto xc = autocast_like(x, x);
    const int64_t out_features = weight.size(0);
    TORCH_CHECK(xc.size(-1) == weight.size(1), "d9d::model::float8_linear: x has ", xc.size(-1),
                " features, the weight ", weight.size(1));
    const auto w = how.weight.data.defined()
                       ? how.weight
                       : kernels::float8_quantize(autocast_weight(weight, x), e4m3, how.rowwise);
    const auto [rows, columns] = quantized_input(x, xc, how.rowwise, weight_trains);
    const auto y = kernels::float8_matmul(rows, w, xc.scalar_type(), /*fast_accum=*/true);
    ctx->saved_data["queue"] = queue_address;
    ctx->saved_data["rowwise"] = how.rowwise;
    // A gathered weight's transpose is kept on `how` for the step's later microbatches.
    ctx->saved_data["gathered_how"] = how.weight.data.defined() ? how_address : int64_t{0};
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["w_data"] = w.data;
    ctx->saved_data["w_scale"] = w.scale;
    if (weight_trains) {
      ctx->saved_data["xt_data"] = columns.data;
      ctx->saved_data["xt_scale"] = columns.scale;
    }
    auto sizes = xc.sizes().vec();
    sizes.back() = out_features;
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool rowwise = ctx->saved_data["rowwise"].toBool();
    const auto gradient_format = rowwise ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
    const kernels::Float8Tensor w{.data = ctx->saved_data["w_data"].toTensor(),
                                  .scale = ctx->saved_data["w_scale"].toTensor()};
    const int64_t out_features = w.data.size(0);
    const auto g = grads[0].reshape({-1, out_features});
    torch::autograd::variable_list out(5);  // x, weight, how, weight_trains, queue address
    // g per token along the outputs (for dx), and per output along the tokens (for dW). dx = g W
    // with W = diag(s) Wq per row: s folds into g's columns before its rows are quantised (powers
    // of two: exact), so W's float8 bytes serve transposed as they are, with unit scales, and are
    // never quantised twice; per tensor, W keeps its one scale.
    const at::Tensor w_factor = rowwise ? w.scale.view({1, out_features}) : at::Tensor();
    kernels::Float8Tensor g_rows;
    kernels::Float8Tensor g_columns;
    if (ctx->needs_input_grad(0) && ctx->needs_input_grad(1)) {
      std::tie(g_rows, g_columns) =
          kernels::float8_quantize_both(g, gradient_format, rowwise, w_factor);
    } else if (ctx->needs_input_grad(0)) {
      g_rows = kernels::float8_quantize(g, gradient_format, rowwise, false, w_factor);
    } else if (ctx->needs_input_grad(1)) {
      g_columns = kernels::float8_quantize(g, gradient_format, rowwise, /*transpose=*/true);
    }
    if (ctx->needs_input_grad(0)) {
      const auto wt = transposed_weight(w, rowwise, ctx->saved_data["gathered_how"].toInt());
      const auto dx = kernels::float8_matmul(g_rows, wt, g.scalar_type());
      auto sizes = grads[0].sizes().vec();
      sizes.back() = w.data.size(1);
      out[0] = dx.view(sizes);
    }
    if (!ctx->needs_input_grad(1)) {
      return out;
    }
    // dW = g^T x: both along the tokens.
    const kernels::Float8Tensor xt{.data = ctx->saved_data["xt_data"].toTensor(),
                                   .scale = ctx->saved_data["xt_scale"].toTensor()};
    const auto dtype = g.scalar_type();
    if (auto* queue = deferring_queue(ctx); queue != nullptr) {
      queue->push([gt = std::move(g_columns), xt, dtype,
                   weight = ctx->saved_data["weight"].toTensor()]() mutable {
        accumulate(weight, kernels::float8_matmul(gt, xt, dtype));
      });
      return out;
    }
    out[1] = kernels::float8_matmul(g_columns, xt, dtype);
    return out;
  }
};

// The queue's address, carried through the autograd context (an int64 saved value).
int64_t queue_address(WeightGradQueue* queue) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): carried through the context
  return static_cast<int64_t>(reinterpret_cast<std::intptr_t>(queue));
}

}  // namespace

at::Tensor low_rank_linear(const at::Tensor& x, const at::Tensor& weight,
                           const LowRankUpdate& update) {
  return LowRankLinear::apply(x, weight, update.a, update.b, update.scale,
                              queue_address(recording_weight_grads()));
}

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, const Float8Linear& how) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): carried through the context
  const auto how_address = static_cast<int64_t>(reinterpret_cast<std::intptr_t>(&how));
  // Whether backward will want W's gradient (forward runs with gradients off, so ask here).
  const bool weight_trains = at::GradMode::is_enabled() && weight.requires_grad();
  return Float8LinearFunction::apply(x, weight, how_address, weight_trains,
                                     queue_address(recording_weight_grads()));
}

at::Tensor silu_mul_linear(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& weight) {
  return SiluMulLinear::apply(gate, up, weight, queue_address(recording_weight_grads()));
}

namespace {

// Whether the fused autograd nodes may run `layer`: the fused kernels on, no bias, adapter or
// float8.
bool plain(const LinearImpl& layer) {
  return fused_kernels() && !layer.bias.defined() && !layer.adapter && !layer.float8;
}

bool all_plain(std::initializer_list<LinearImpl*> layers) {
  return std::ranges::all_of(layers, [](const LinearImpl* layer) { return plain(*layer); });
}

// The layers' low-rank updates when every layer would run low_rank_linear (the fused kernels on,
// no bias or float8, an adapter that is a low-rank update now) and their scales are equal; empty
// otherwise.
std::vector<LowRankUpdate> common_low_rank(std::initializer_list<LinearImpl*> layers) {
  std::vector<LowRankUpdate> updates;
  if (!fused_kernels()) {
    return updates;
  }
  for (const auto* layer : layers) {
    if (layer->bias.defined() || layer->float8 || !layer->adapter) {
      return {};
    }
    auto update = layer->adapter->low_rank();
    if (!update.a.defined() || (!updates.empty() && update.scale != updates.front().scale)) {
      return {};
    }
    updates.push_back(std::move(update));
  }
  return updates;
}

}  // namespace

std::vector<at::Tensor> fan_out_linear(const at::Tensor& x,
                                       std::initializer_list<LinearImpl*> layers) {
  std::vector<at::Tensor> outputs;
  if (!all_plain(layers)) {
    if (const auto updates = common_low_rank(layers); !updates.empty()) {
      std::vector<at::Tensor> weights;
      std::vector<at::Tensor> as;
      std::vector<at::Tensor> bs;
      for (std::size_t i = 0; i < updates.size(); ++i) {
        weights.push_back(std::data(layers)[i]->weight);
        as.push_back(updates[i].a);
        bs.push_back(updates[i].b);
      }
      return LowRankFanOutLinear::apply(x, at::TensorList(weights), at::TensorList(as),
                                        at::TensorList(bs), updates.front().scale,
                                        queue_address(recording_weight_grads()));
    }
    for (auto* layer : layers) {
      outputs.push_back(layer->forward(x));
    }
    return outputs;
  }
  std::vector<at::Tensor> weights;
  for (const auto* layer : layers) {
    weights.push_back(layer->weight);
  }
  return FanOutLinear::apply(x, at::TensorList(weights), queue_address(recording_weight_grads()));
}

std::vector<at::Tensor> fan_out_linear_gathered(const at::Tensor& x,
                                                std::initializer_list<LinearImpl*> layers,
                                                const TensorParallelGroup& group) {
  if (!all_plain(layers) || !group.sequence_parallel() || x.dim() < 2) {
    return fan_out_linear(group.copy_in(x), layers);
  }
  std::vector<at::Tensor> weights;
  for (const auto* layer : layers) {
    weights.push_back(layer->weight);
  }
  return GatheredFanOutLinear::apply(x, at::TensorList(weights),
                                     GatheredFanOutLinear::address_of(group),
                                     queue_address(recording_weight_grads()));
}

at::Tensor linear_scattered(const at::Tensor& h, LinearImpl& layer,
                            const TensorParallelGroup& group) {
  if (!plain(layer) || !group.sequence_parallel() || h.dim() < 2 || h.size(1) % group.size() != 0) {
    return group.reduce_out(
        layer.forward(h));  // reduce_out explains a sequence that does not split
  }
  return ScatteredLinear::apply(h, h, layer.weight, /*gated=*/false,
                                GatheredFanOutLinear::address_of(group),
                                queue_address(recording_weight_grads()));
}

namespace {

// down(silu(gate) * up) on whole rows: the fused node that recomputes the product in backward when
// the layer is plain or has a low-rank adapter (LoRA without active dropout), otherwise the layer
// over the fused (or, with the fused kernels off, plain) activation.
at::Tensor silu_mul_down(const at::Tensor& gate, const at::Tensor& up, LinearImpl& layer) {
  if (plain(layer)) {
    return silu_mul_linear(gate, up, layer.weight);
  }
  if (fused_kernels() && layer.adapter && !layer.bias.defined() && !layer.float8) {
    if (const auto update = layer.adapter->low_rank(); update.a.defined()) {
      return SiluMulLowRankLinear::apply(gate, up, layer.weight, update.a, update.b, update.scale,
                                         queue_address(recording_weight_grads()));
    }
  }
  return layer.forward(fused_kernels() ? kernels::silu_mul(gate, up) : at::silu(gate) * up);
}

}  // namespace

at::Tensor silu_mul_linear_scattered(const at::Tensor& gate, const at::Tensor& up,
                                     LinearImpl& layer, const TensorParallelGroup& group) {
  if (!plain(layer) || !group.sequence_parallel() || gate.dim() < 2 ||
      gate.size(1) % group.size() != 0) {
    return group.reduce_out(silu_mul_down(gate, up, layer));
  }
  return ScatteredLinear::apply(gate, up, layer.weight, /*gated=*/true,
                                GatheredFanOutLinear::address_of(group),
                                queue_address(recording_weight_grads()));
}

at::Tensor SwiGluImpl::forward(const at::Tensor& x) {
  // Under tensor parallelism x is gathered first (copy_in) and the output reduce-scattered, each
  // overlapped with its GEMMs under sequence parallelism.
  if (tp_) {
    const auto gate_up = fan_out_linear_gathered(x, {gate_proj.get(), up_proj.get()}, *tp_);
    return silu_mul_linear_scattered(gate_up[0], gate_up[1], *down_proj, *tp_);
  }
  const auto gate_up = fan_out_linear(x, {gate_proj.get(), up_proj.get()});
  return silu_mul_down(gate_up[0], gate_up[1], *down_proj);
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias) {
  weight = register_parameter("weight", at::empty({out_features, in_features}));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias) {
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    this->bias = register_parameter("bias", at::empty({out_features}));
    const at::NoGradGuard no_grad;
    this->bias.uniform_(-bound, bound);
  }
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  if (float8) {
    auto y = float8_linear(x, weight, *float8);
    if (bias.defined()) {
      y = y + bias.to(y.scalar_type());
    }
    if (adapter) {
      if (const auto delta = adapter->forward(x); delta.defined()) {
        y = y + delta;
      }
    }
    return y;
  }
  if (adapter && !bias.defined() && fused_kernels()) {
    if (const auto update = adapter->low_rank(); update.a.defined()) {
      return low_rank_linear(x, weight, update);
    }
  }
  at::Tensor y;
  auto* queue = recording_weight_grads();
  // Without a queue, at::linear — unless autocast casts the weight: the autograd function then
  // takes the step's cached cast and (on CUDA) has the GEMM write the float32 gradient, where
  // at::linear casts again per microbatch and rounds the gradient to bfloat16 before converting.
  const auto dtype = autocast_dtype(x);
  const bool casts_weight = dtype && weight.scalar_type() != *dtype;
  if (queue == nullptr && !casts_weight) {
    y = at::linear(x, weight, bias);
  } else {
    const auto address = queue_address(queue);
    y = bias.defined() ? SplitLinear<true>::apply(x, weight, bias, address)
                       : SplitLinear<false>::apply(x, weight, address);
  }
  if (adapter) {
    // The adapter's own layers (d9d::model::Linear) split their backward the same way.
    const auto delta = adapter->forward(x);
    if (delta.defined()) {
      y = y + delta;
    }
  }
  return y;
}

}  // namespace d9d::model
