// d9d/parallel/moe_balance.cpp — the step's router bookkeeping for models with MoE layers: the
// loads of the step summed over the ranks that route different tokens (data- and tensor-
// parallel), the auxiliary-loss-free bias update, and the routers' balance as metrics.
#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/core/collectives.hpp>
#include <d9d/model/moe.hpp>
#include <d9d/parallel/parallelize.hpp>

namespace d9d::parallel::detail {
namespace {

// "moe/load_max_over_mean/layer_<l>": layer l's max/mean expert load at the step.
constexpr std::string_view kLayerBalancePrefix = "moe/load_max_over_mean/layer_";

class MoeBalanceSync : public GradientSync {
 public:
  // `expert_ranks`: ep (each rank holds a contiguous num_experts / ep of every layer's experts).
  MoeBalanceSync(std::vector<std::shared_ptr<model::MoeLayerImpl>> layers, ProcessGroup group,
                 int64_t expert_ranks)
      : layers_(std::move(layers)), group_(std::move(group)), expert_ranks_(expert_ranks) {}

  // After the step's backward: every rank has routed its tokens of every microbatch.
  void finish() override {
    std::vector<at::Tensor> loads;
    loads.reserve(layers_.size());
    double dropped = 0.0;
    for (const auto& layer : layers_) {
      auto load = layer->take_load();
      loads.push_back(load.routed);
      dropped += static_cast<double>(load.dropped);
    }
    // [layers + 1, experts] float64: the loads, and the dropped routings in the last row's first
    // entry, summed over the ranks in one all-reduce.
    auto all = at::cat({at::stack(loads), at::zeros({1, loads.front().size(0)}, at::kDouble)});
    all[static_cast<int64_t>(layers_.size())][0] = dropped;
    if (group_.valid() && group_.size() > 1) {
      all = all_reduce(group_, all);
    }
    dropped = all[static_cast<int64_t>(layers_.size())][0].item<double>();
    double sum_ratio = 0.0;
    double worst = 0.0;
    double routed = 0.0;
    // The most loaded expert-parallel rank's rows over its balanced share (1 without ep): the
    // rows its experts run and the all-to-alls wait for (d9d::advise::ExpertSplit::load).
    double sum_rank = 0.0;
    double worst_rank = 0.0;
    std::vector<double> ratios;
    ratios.reserve(layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const auto load = all[static_cast<int64_t>(l)];
      layers_[l]->gate->update_bias(load);
      const double mean = load.mean().item<double>();
      const double ratio = mean > 0 ? load.max().item<double>() / mean : 1.0;
      ratios.push_back(ratio);
      sum_ratio += ratio;
      worst = std::max(worst, ratio);
      const double total = load.sum().item<double>();
      routed += total;
      const double rank_load = total > 0
                                   ? load.reshape({expert_ranks_, -1}).sum(1).max().item<double>() /
                                         (total / static_cast<double>(expert_ranks_))
                                   : 1.0;
      sum_rank += rank_load;
      worst_rank = std::max(worst_rank, rank_load);
    }
    metrics_ = {{"moe/load_max_over_mean", sum_ratio / static_cast<double>(layers_.size())},
                {"moe/load_max_over_mean_worst_layer", worst},
                {"moe/routed_per_step", routed},
                {"moe/ep_rank_load_max", sum_rank / static_cast<double>(layers_.size())},
                {"moe/ep_rank_load_max_worst_layer", worst_rank},
                {"moe/dropped", dropped},
                {"moe/dropped_fraction", routed > 0 ? dropped / routed : 0.0}};
    if (const auto stats = layers_.front()->last_stats()) {
      metrics_.emplace_back("moe/aux_loss", stats->aux_loss());
    }
    // Every layer's balance (the run's router_balance.svg draws them), numbered in model order
    // with as many digits as the largest number, so the names sort.
    const auto digits = std::to_string(layers_.size() - 1).size();
    for (std::size_t l = 0; l < ratios.size(); ++l) {
      auto number = std::to_string(l);
      number.insert(0, digits - number.size(), '0');
      metrics_.emplace_back(std::string(kLayerBalancePrefix) + number, ratios[l]);
    }
  }

  [[nodiscard]] std::vector<std::pair<std::string, double>> metrics() const override {
    return metrics_;
  }

 private:
  std::vector<std::shared_ptr<model::MoeLayerImpl>> layers_;
  ProcessGroup group_;
  int64_t expert_ranks_ = 1;
  std::vector<std::pair<std::string, double>> metrics_;
};

}  // namespace

void apply_moe_balance(ParallelModel& model) {
  std::vector<std::shared_ptr<model::MoeLayerImpl>> layers;
  for (const auto& module : model.modules()) {
    auto found = model::moe_layers(*module);
    layers.insert(layers.end(), found.begin(), found.end());
  }
  if (layers.empty()) {
    return;
  }
  // The ranks that route different tokens: the data-parallel ones, and under tensor parallelism
  // the tp ranks too (each routes its part of the sequence: MoeLayerImpl::set_tensor_parallel).
  const auto& mesh = model.mesh();
  const auto group = mesh.size(MeshDomain::batch, "tp") > 1
                         ? mesh.group(MeshDomain::batch, std::vector<std::string>{"dp", "tp"})
                         : mesh.group(MeshDomain::batch, "dp");
  for (const auto& layer : layers) {
    layer->set_load_group(group);
  }
  model.add_sync(std::make_unique<MoeBalanceSync>(std::move(layers), group,
                                                  mesh.size(MeshDomain::expert, "ep_shard")));
}

}  // namespace d9d::parallel::detail
