// d9d/model/moe.cpp — router, grouped experts, the MoE layer and its load-balancing statistics.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/kernels/moe_permute.hpp>
#include <d9d/model/moe.hpp>
#include <d9d/model/tensor_parallel.hpp>

namespace d9d::model {
namespace {

// Turns autocast off for one device type while alive (the router computes in float32 or wider).
class AutocastOff {
 public:
  explicit AutocastOff(c10::DeviceType device)
      : device_(device), previous_(at::autocast::is_autocast_enabled(device)) {
    at::autocast::set_autocast_enabled(device_, false);
  }
  ~AutocastOff() { at::autocast::set_autocast_enabled(device_, previous_); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;
  AutocastOff(AutocastOff&&) = delete;
  AutocastOff& operator=(AutocastOff&&) = delete;

 private:
  c10::DeviceType device_;
  bool previous_;
};

// Identity on the layer's output; its backward also gives the layer's summed router probabilities
// the auxiliary loss's gradient (read from the pass's MoeForwardStats, filled after the pass).
struct AuxLossGradient : torch::autograd::Function<AuxLossGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out,
                            const at::Tensor& probability_sum, const at::Tensor& gradient) {
    ctx->saved_data["gradient"] = gradient;
    ctx->saved_data["sizes"] = probability_sum.sizes();
    return out.view_as(out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto gradient = ctx->saved_data["gradient"].toTensor();
    if (gradient.sizes() != at::IntArrayRef(ctx->saved_data["sizes"].toIntVector())) {
      throw std::logic_error(
          "d9d::model::MoeLayer: the auxiliary loss's gradient is missing. Fix: call "
          "MoeForwardStats::finish() after the forward pass's last MoE layer");
    }
    return {grads[0], gradient.clone(), at::Tensor()};
  }
};

void check_options(const MoeOptions& o) {
  const std::pair<const char*, int64_t> sizes[] = {{"hidden_size", o.hidden_size},
                                                   {"num_experts", o.num_experts},
                                                   {"top_k", o.top_k},
                                                   {"intermediate_size", o.intermediate_size}};
  for (const auto& [name, value] : sizes) {
    if (value < 1) {
      throw std::invalid_argument(std::string("d9d::model::MoeOptions: ") + name + " = " +
                                  std::to_string(value) + " must be >= 1");
    }
  }
  if (o.top_k > o.num_experts) {
    throw std::invalid_argument("d9d::model::MoeOptions: top_k = " + std::to_string(o.top_k) +
                                " exceeds num_experts = " + std::to_string(o.num_experts));
  }
  if (o.shared_expert_intermediate_size < 0 || o.bias_update_rate < 0) {
    throw std::invalid_argument(
        "d9d::model::MoeOptions: shared_expert_intermediate_size and bias_update_rate must be "
        ">= 0");
  }
}

std::vector<int64_t> to_vector(const at::Tensor& counts) {
  const auto host = counts.to(at::kCPU, at::kLong).contiguous();
  const auto* data = host.data_ptr<int64_t>();
  return {data, data + host.numel()};
}

}  // namespace

at::Tensor host_index_tensor(const std::vector<int64_t>& values, const c10::Device& device,
                             at::ScalarType dtype) {
  auto host = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  if (dtype != at::kLong) {
    host = host.to(dtype);
  }
  if (!device.is_cuda()) {
    return host.to(device);
  }
  // The caching host allocator keeps the pinned block until the copy on the stream is done.
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w,
                          const std::vector<int64_t>& counts, GroupedGemm how) {
  if (w.dim() != 3 || x.dim() != 2 || x.size(1) != w.size(2) ||
      static_cast<int64_t>(counts.size()) != w.size(0)) {
    throw std::invalid_argument("d9d::model::grouped_linear: x " + c10::str(x.sizes()) + ", w " +
                                c10::str(w.sizes()) + " and " + std::to_string(counts.size()) +
                                " group counts do not fit (x [M, K], w [G, N, K], G counts)");
  }
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total != x.size(0)) {
    throw std::invalid_argument("d9d::model::grouped_linear: the counts sum to " +
                                std::to_string(total) + ", x has " + std::to_string(x.size(0)) +
                                " rows");
  }
  const bool grouped = how == GroupedGemm::grouped_mm ||
                       (how == GroupedGemm::automatic && x.is_cuda() &&
                        x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16);
  if (grouped) {
    std::vector<int64_t> ends(counts.size());
    int64_t end = 0;
    for (std::size_t g = 0; g < counts.size(); ++g) {
      end += counts[g];
      ends[g] = end;
    }
    const auto offsets = host_index_tensor(ends, x.device(), at::kInt);
    return at::_grouped_mm(x, w.transpose(-2, -1), offsets);
  }
  // Every group, also the empty ones: their weights then get zero gradients, not none.
  std::vector<at::Tensor> parts;
  parts.reserve(counts.size());
  int64_t offset = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    parts.push_back(
        at::linear(x.narrow(0, offset, counts[g]), w.select(0, static_cast<int64_t>(g))));
    offset += counts[g];
  }
  return at::cat(parts, 0);
}

// ---- MoeForwardStats ---------------------------------------------------------------------------

MoeForwardStats::MoeForwardStats(double aux_loss_coef, MoeAuxLoss kind)
    : coef_(aux_loss_coef), kind_(kind) {}

namespace {

// The recorded layer of that index in `layers` (const or not), or null.
template <class Layers>
auto* layer_of(Layers& layers, int64_t index) {
  for (auto& known : layers) {
    if (known.index == index) {
      return &known;
    }
  }
  return static_cast<decltype(&layers.front())>(nullptr);
}

}  // namespace

MoeForwardStats::Layer* MoeForwardStats::find(int64_t layer) { return layer_of(layers_, layer); }

bool MoeForwardStats::record(int64_t layer, const at::Tensor& counts,
                             const at::Tensor& probability_sum, int64_t tokens,
                             const ProcessGroup& group) {
  if (find(layer) != nullptr) {
    return false;
  }
  if (finished_) {
    throw std::logic_error("d9d::model::MoeForwardStats: layer " + std::to_string(layer) +
                           " recorded after finish()");
  }
  const int64_t dims = kind_ == MoeAuxLoss::sequence ? 2 : 1;
  if (counts.dim() != dims || counts.sizes() != probability_sum.sizes()) {
    throw std::invalid_argument(
        "d9d::model::MoeForwardStats: layer " + std::to_string(layer) + " recorded counts " +
        c10::str(counts.sizes()) + " and probability sums " + c10::str(probability_sum.sizes()) +
        (dims == 2 ? "; the sequence-wise loss takes [B, E] each" : "; expected [E] each"));
  }
  layers_.push_back({.index = layer,
                     .counts = counts.detach(),
                     .probability_sum = probability_sum.detach(),
                     .tokens = tokens,
                     .gradient = at::Tensor()});
  if (group.valid()) {
    group_ = group;
  }
  return true;
}

at::Tensor MoeForwardStats::gradient_holder(int64_t layer, const at::Tensor& like) {
  auto* known = find(layer);
  if (known == nullptr) {
    throw std::logic_error("d9d::model::MoeForwardStats: layer " + std::to_string(layer) +
                           " asked for its gradient before recording");
  }
  if (!known->gradient.defined()) {
    known->gradient = at::empty({0}, like.options().requires_grad(false));
  }
  return known->gradient;
}

at::Tensor MoeForwardStats::aux_gradient(int64_t layer) const {
  const auto* known = layer_of(layers_, layer);
  return known != nullptr ? known->gradient : at::Tensor();
}

void MoeForwardStats::finish() {
  if (finished_) {
    return;
  }
  finished_ = true;
  if (layers_.empty()) {
    return;
  }
  const at::NoGradGuard no_grad;
  if (kind_ == MoeAuxLoss::sequence) {
    finish_sequence();
  } else {
    finish_global_batch();
  }
}

namespace {

// Fills a layer's gradient holder (created by its forward when the loss has a gradient) with
// `gradient`, in the holder's dtype; a layer without one gets the tensor itself.
void fill(at::Tensor& holder, const at::Tensor& gradient, c10::ScalarType dtype) {
  if (holder.defined()) {
    holder.resize_(gradient.sizes());
    holder.copy_(gradient);
  } else {
    holder = gradient.to(dtype);
  }
}

}  // namespace

void MoeForwardStats::finish_global_batch() {
  const auto& first = layers_.front().probability_sum;
  const auto options = first.options().dtype(at::kDouble);
  const int64_t experts = first.size(0);
  // f: the (layer, token) routings per expert over the pass's layers, summed over the group with
  // the number of (layer, token) pairs, in one all-reduce.
  auto totals = at::zeros({experts + 1}, options);
  auto probability = at::zeros({experts}, options);
  int64_t tokens = 0;
  for (const auto& layer : layers_) {
    totals.narrow(0, 0, experts).add_(layer.counts.to(options));
    probability.add_(layer.probability_sum.to(options));
    tokens += layer.tokens;
  }
  totals[experts] = static_cast<double>(tokens);
  if (group_.valid() && group_.size() > 1) {
    totals = all_reduce(group_, totals);
  }
  const auto pairs = totals[experts].item<double>();
  const auto fraction = totals.narrow(0, 0, experts) / pairs;
  const auto e = static_cast<double>(experts);
  aux_ = tokens == 0
             ? 0.0
             : (fraction * probability).sum().item<double>() * e / static_cast<double>(tokens);
  const auto gradient = fraction * (coef_ * e / static_cast<double>(layers_.size()));
  for (auto& layer : layers_) {
    fill(layer.gradient, gradient, first.scalar_type());
  }
}

void MoeForwardStats::finish_sequence() {
  const auto layers = static_cast<double>(layers_.size());
  double sum = 0.0;
  for (auto& layer : layers_) {
    const auto options = layer.probability_sum.options().dtype(at::kDouble);
    const auto counts = layer.counts.to(options);  // [B, E]
    const int64_t rows = counts.size(0);
    const auto experts = static_cast<double>(counts.size(1));
    // Row b routed k T times in all; f = E / (k T) * counts, P = probability sums / T.
    const auto routings = at::clamp_min(counts.sum(1, /*keepdim=*/true), 1.0);
    const auto fraction = counts * experts / routings;
    const double length =
        rows == 0 ? 1.0 : static_cast<double>(layer.tokens) / static_cast<double>(rows);
    if (rows > 0) {
      sum += (fraction * layer.probability_sum.to(options)).sum().item<double>() /
             (length * static_cast<double>(rows));
    }
    // d(coef * aux * tokens)/d(probability sums of row b) = coef * tokens * f / (L B T), and the
    // layer's tokens are B T.
    fill(layer.gradient, fraction * (coef_ / layers), layer.probability_sum.scalar_type());
  }
  aux_ = sum / layers;
}

// ---- MoeRouter ---------------------------------------------------------------------------------

MoeRouterImpl::MoeRouterImpl(const MoeOptions& options) : options_(options) {
  check_options(options);
  weight =
      register_parameter("weight", at::randn({options.num_experts, options.hidden_size}) * 0.02);
  if (options.bias_update_rate > 0) {
    expert_bias = register_buffer("expert_bias", at::zeros({options.num_experts}));
  }
}

MoeRouterImpl::Routing MoeRouterImpl::forward(const at::Tensor& x) {
  const AutocastOff no_autocast(x.device().type());
  const auto dtype = at::promote_types(x.scalar_type(), at::kFloat);
  const auto logits = at::linear(x.to(dtype), weight.to(dtype));
  Routing routing;
  routing.probabilities = at::softmax(logits, -1);
  if (expert_bias.defined()) {
    // The bias steers the choice only, on the logits; the weights stay the probabilities.
    const at::NoGradGuard no_grad;
    const auto scores = logits.detach() + expert_bias.to(dtype);
    routing.experts = std::get<1>(at::topk(scores, options_.top_k, -1));
  }
  if (expert_bias.defined()) {
    routing.weights = routing.probabilities.gather(1, routing.experts);
  } else {
    auto [values, indices] = at::topk(routing.probabilities, options_.top_k, -1);
    routing.experts = indices;
    routing.weights = values;
  }
  if (options_.norm_topk_prob) {
    routing.weights = routing.weights / routing.weights.sum(-1, /*keepdim=*/true);
  }
  return routing;
}

void MoeRouterImpl::update_bias(const at::Tensor& load) {
  if (!expert_bias.defined()) {
    return;
  }
  const at::NoGradGuard no_grad;
  const auto routed = load.to(expert_bias.device(), at::kDouble);
  const auto mean = routed.mean();
  at::Tensor step;
  if (options_.bias_update_rule == MoeBiasRule::proportional) {
    // A mean below one routing counts as one (nothing routed: no step, no division by zero).
    step = (mean - routed) / at::clamp_min(mean, 1.0) * options_.bias_update_rate;
  } else {
    step = at::sign(mean - routed) * options_.bias_update_rate;
  }
  expert_bias.add_(step.to(expert_bias.scalar_type()));
}

// ---- GroupedExperts ----------------------------------------------------------------------------

GroupedExpertsImpl::GroupedExpertsImpl(const MoeOptions& options) : options_(options) {
  check_options(options);
  const int64_t e = options.num_experts;
  const int64_t h = options.hidden_size;
  const int64_t i = options.intermediate_size;
  gate_proj = register_parameter("gate_proj", at::randn({e, i, h}) * 0.02);
  up_proj = register_parameter("up_proj", at::randn({e, i, h}) * 0.02);
  down_proj = register_parameter("down_proj", at::randn({e, h, i}) * 0.02);
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& rows, const std::vector<int64_t>& counts) {
  // Autocast's dtype, else the rows' (fp32 weights meet bf16 activations under FullyShard).
  const auto dtype = d9d::detail::autocast_dtype(rows).value_or(rows.scalar_type());
  const auto x = rows.to(dtype);
  // Each projection, plus its adapter's low-rank addition: the rows times A_e^T (rank columns),
  // scaled there (a pass over rank columns, not out columns), times B_e^T.
  const auto project = [&](const at::Tensor& in, std::size_t index) {
    auto out = grouped_linear(in, projection(index).to(dtype), counts, gemm);
    if (const auto& adapter = adapters.at(index)) {
      if (const auto update = adapter->low_rank(); update.a.defined()) {
        // at::_grouped_mm needs 16-byte rows: bfloat16 ranks that are multiples of 8.
        const auto how =
            gemm == GroupedGemm::automatic && update.a.size(1) % 8 != 0 ? GroupedGemm::loop : gemm;
        const auto low = grouped_linear(in, update.a.to(dtype), counts, how) * update.scale;
        out = out + grouped_linear(low, update.b.to(dtype), counts, how);
      }
    }
    return out;
  };
  return project(at::silu(project(x, 0)) * project(x, 1), 2);
}

at::Tensor& GroupedExpertsImpl::projection(std::size_t index) {
  switch (index) {
    case 0:
      return gate_proj;
    case 1:
      return up_proj;
    case 2:
      return down_proj;
    default:
      throw std::out_of_range("d9d::model::GroupedExperts: no projection " + std::to_string(index) +
                              " (gate_proj, up_proj, down_proj are 0-2)");
  }
}

std::size_t GroupedExpertsImpl::projection_index(std::string_view name) {
  std::size_t index = 0;
  while (index < projections.size() && projections.at(index) != name) {
    ++index;
  }
  return index;
}

at::Tensor GroupedExpertsImpl::run(const at::Tensor& rows, const at::Tensor& counts) {
  if (dispatcher_) {
    return dispatcher_->dispatch(
        rows, counts, [this](const at::Tensor& local, const std::vector<int64_t>& local_counts) {
          return forward(local, local_counts);
        });
  }
  return forward(rows, to_vector(counts));
}

void GroupedExpertsImpl::set_expert_parallel(int64_t first,
                                             std::shared_ptr<ExpertDispatcher> dispatcher) {
  first_expert_ = first;
  dispatcher_ = std::move(dispatcher);
}

// ---- MoeLayer ----------------------------------------------------------------------------------

MoeLayerImpl::MoeLayerImpl(const MoeOptions& options, int64_t layer_index)
    : options_(options), layer_index_(layer_index) {
  check_options(options);
  gate = register_module("gate", MoeRouter(options));
  experts = register_module("experts", GroupedExperts(options));
  if (options.shared_expert_intermediate_size > 0) {
    shared_expert = register_module(
        "shared_expert", SwiGlu(options.hidden_size, options.shared_expert_intermediate_size));
    shared_expert_gate = register_module("shared_expert_gate", Linear(options.hidden_size, 1));
  }
  routed_ = at::zeros({options.num_experts}, at::kDouble);
}

void MoeLayerImpl::set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) {
  tp_ = std::move(group);
}

at::Tensor MoeLayerImpl::forward(const at::Tensor& x,
                                 const std::shared_ptr<MoeForwardStats>& stats) {
  if (!tp_ || tp_->size() <= 1 || tp_->sequence_parallel()) {
    return forward_tokens(x, stats);
  }
  // The whole sequence on every tp rank: each routes its part, the parts are gathered again.
  const auto rows = x.dim() == 3 ? x : x.reshape({1, -1, x.size(-1)});  // else: one sequence
  return tp_->gather_sequence(forward_tokens(tp_->split_sequence(rows), stats)).view(x.sizes());
}

at::Tensor MoeLayerImpl::forward_tokens(const at::Tensor& x,
                                        const std::shared_ptr<MoeForwardStats>& stats) {
  const int64_t hidden = options_.hidden_size;
  const int64_t k = options_.top_k;
  const auto flat = x.reshape({-1, hidden});
  const int64_t tokens = flat.size(0);
  const auto routing = gate(flat);

  // Permute: the (token, slot) pairs sorted by expert (stable: token order within an expert).
  const auto chosen = routing.experts.reshape({-1});
  const int64_t capacity = expert_capacity(options_, tokens);
  at::Tensor counts;
  at::Tensor out;
  int64_t dropped = 0;
  if (fused_kernels()) {
    // The indices on the device (d9d/kernels/moe_permute.hpp), one gather, one weighted sum per
    // token. Dropless, every routing is kept and the experts read the counts to the host (the
    // grouped GEMM's segments; under expert parallelism with the dispatcher's exchange): one
    // synchronisation. With a capacity the kept rows are counted here first.
    const auto route = kernels::moe_route_indices(chosen, options_.num_experts, k, capacity);
    int64_t kept = chosen.numel();
    at::Tensor kept_counts = route.kept_counts;
    if (capacity >= 0) {
      const auto host = to_vector(route.kept_counts);
      kept = std::accumulate(host.begin(), host.end(), int64_t{0});
      kept_counts = at::tensor(host, at::TensorOptions().dtype(at::kLong));
    }
    counts = route.counts;
    dropped = chosen.numel() - kept;
    const auto outputs = experts->run(
        kernels::moe_permute(flat, route.token.narrow(0, 0, kept), route.position), kept_counts);
    out = kernels::moe_unpermute(outputs.to(x.scalar_type()), routing.weights.to(x.scalar_type()),
                                 route.position);
  } else {
    // The ATen composition the kernels replace (the CPU kernels equal it in float32 / float64).
    auto [sorted_experts, order] =
        at::sort(chosen, std::optional<bool>(true), /*dim=*/0, /*descending=*/false);
    counts = at::bincount(chosen, {}, options_.num_experts);
    auto kept_counts = counts;
    if (capacity >= 0) {
      // Token dropping: each expert keeps the first `capacity` of its routings.
      order = order.masked_select(within_capacity(sorted_experts, counts, capacity));
      kept_counts = at::clamp_max(counts, capacity);
      dropped = chosen.numel() - order.numel();
    }
    const auto token = at::div(order, k, "floor");
    const auto outputs = experts->run(flat.index_select(0, token), kept_counts);
    // Un-permute: each pair's output weighted, summed per token (in expert order, as
    // transformers).
    const auto weights = routing.weights.to(x.scalar_type()).reshape({-1}).index_select(0, order);
    out = at::zeros_like(flat).index_add(0, token, outputs * weights.unsqueeze(1));
  }
  if (shared_expert) {
    out = out + at::sigmoid(shared_expert_gate(flat)) * shared_expert(flat);
  }

  bool first_time = true;
  if (stats) {
    at::Tensor recorded_counts = counts;
    at::Tensor probability_sum;
    if (stats->aux_loss_kind() == MoeAuxLoss::sequence) {
      // Per row of the input ([..., T, hidden]; a 2-d input is one sequence).
      const int64_t rows = x.dim() >= 3 ? tokens / std::max<int64_t>(x.size(-2), 1) : 1;
      const int64_t length = rows == 0 ? 0 : tokens / rows;
      const auto chosen_by_row = routing.experts.reshape({rows, length * k});
      recorded_counts = at::zeros({rows, options_.num_experts}, chosen_by_row.options())
                            .scatter_add_(1, chosen_by_row, at::ones_like(chosen_by_row));
      probability_sum = routing.probabilities.reshape({rows, length, -1}).sum(1);
    } else {
      probability_sum = routing.probabilities.sum(0);
    }
    first_time = stats->record(layer_index_, recorded_counts, probability_sum, tokens, load_group_);
    last_stats_ = stats;
    if (stats->aux_loss_coef() > 0 && at::GradMode::is_enabled() &&
        probability_sum.requires_grad()) {
      out = AuxLossGradient::apply(out, probability_sum,
                                   stats->gradient_holder(layer_index_, probability_sum));
    }
  }
  if (first_time && is_training()) {
    const at::NoGradGuard no_grad;
    // Accumulated where the counts are (no synchronisation); take_load() reads it per step.
    if (routed_.device() != counts.device()) {
      routed_ = routed_.to(counts.device());
    }
    routed_.add_(counts.to(at::kDouble));
    tokens_ += tokens;
    dropped_ += dropped;
  }
  return out.view(x.sizes());
}

RouterLoad MoeLayerImpl::take_load() {
  RouterLoad load{
      .routed = routed_.to(at::kCPU, at::kDouble, /*non_blocking=*/false, /*copy=*/true),
      .tokens = tokens_,
      .dropped = dropped_};
  routed_.zero_();
  tokens_ = 0;
  dropped_ = 0;
  return load;
}

// ---- helpers -----------------------------------------------------------------------------------

int64_t expert_capacity(const MoeOptions& options, int64_t tokens) {
  if (options.capacity_factor <= 0) {
    return -1;
  }
  return static_cast<int64_t>(std::ceil(options.capacity_factor * static_cast<double>(tokens) *
                                        static_cast<double>(options.top_k) /
                                        static_cast<double>(options.num_experts)));
}

at::Tensor within_capacity(const at::Tensor& sorted_experts, const at::Tensor& counts,
                           int64_t capacity) {
  if (capacity < 0) {
    return at::ones_like(sorted_experts, at::kBool);
  }
  // A routing's place in its expert's run: its index minus where the run starts.
  const auto starts = at::cumsum(counts, 0) - counts;
  const auto place = at::arange(sorted_experts.numel(), sorted_experts.options()) -
                     starts.index_select(0, sorted_experts);
  return place < capacity;
}

at::Tensor load_balancing_loss(const at::Tensor& probabilities, const at::Tensor& experts,
                               int64_t num_experts) {
  const auto mask = at::one_hot(experts, num_experts).to(probabilities.scalar_type());  // [N,k,E]
  const auto tokens_per_expert = mask.mean(0);                                          // [k, E]
  const auto probability_per_expert = probabilities.mean(0);                            // [E]
  return (tokens_per_expert * probability_per_expert.unsqueeze(0)).sum() *
         static_cast<double>(num_experts);
}

std::vector<std::shared_ptr<MoeLayerImpl>> moe_layers(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<MoeLayerImpl>> out;
  for (const auto& child : module.modules(/*include_self=*/true)) {
    if (auto layer = std::dynamic_pointer_cast<MoeLayerImpl>(child)) {
      out.push_back(std::move(layer));
    }
  }
  return out;
}

}  // namespace d9d::model
