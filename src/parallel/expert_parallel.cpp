// d9d/parallel/expert_parallel.cpp — ExpertParallel: the routed experts of every MoE layer split
// over the expert domain's ep_shard ranks, tokens dispatched and combined by all-to-all.
//
// Layout. Layer experts [E, ...] are split along dim 0: ep_shard rank r holds experts
// [r E/ep, (r + 1) E/ep) (Shard(0) on ep_shard, Replicate on ep_dp_replicate and ep_replicate,
// MeshDomain::expert).
// A layer's rows arrive sorted by global expert with counts per expert; the rows for rank j's
// experts go to j (first all-to-all; the per-expert counts travel first in a small all-to-all of
// their own, on the device, and are read to the host in one copy with the rank's own counts: the
// layer's one synchronisation when dropless), are regrouped there from source-major to
// expert-major, run through the local experts (one grouped GEMM per projection) and travel back in
// reverse (second all-to-all). Both all-to-alls are autograd functions whose backward is the
// reverse all-to-all, so the experts' gradients hold the contributions of every ep_shard rank's
// tokens; summing them over ep_dp_replicate x ep_replicate (the ranks that hold the same experts)
// gives the gradient of the global batch. Under FullyShard with ep_replicate > 1 the experts are
// sharded over ep_replicate as well (fully_shard.cpp), reduce-scattered there and all-reduced over
// ep_dp_replicate (HSDP's replicas); the all-reduce below then has nothing to do.
#include <algorithm>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/core/collectives.hpp>
#include <d9d/model/moe.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/train/config.hpp>

namespace d9d::parallel::detail {
namespace {

// Rows to other ranks and back: all_to_all in forward, the reverse all_to_all in backward.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            int64_t group, const std::vector<int64_t>& send,
                            const std::vector<int64_t>& recv) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the dispatcher's group, alive while its model is
    const auto& g = *reinterpret_cast<const ProcessGroup*>(group);
    return all_to_all(g, rows.contiguous(), send, recv);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): see forward
    const auto& g = *reinterpret_cast<const ProcessGroup*>(ctx->saved_data["group"].toInt());
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    return {all_to_all(g, grads[0].contiguous(), recv, send), torch::autograd::Variable(),
            torch::autograd::Variable(), torch::autograd::Variable()};
  }
};

// Rows in another order: a gather by `order` in forward, the gather by its inverse in backward (a
// permutation's gradient needs no accumulation: index_select's own backward, an index_add, runs
// atomics over the rows and was the dispatcher's slowest kernel on the GPU).
struct PermuteRows : torch::autograd::Function<PermuteRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            const at::Tensor& order, const at::Tensor& inverse) {
    ctx->save_for_backward({inverse});
    return rows.index_select(0, order);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto inverse = ctx->get_saved_variables()[0];
    return {grads[0].index_select(0, inverse), torch::autograd::Variable(),
            torch::autograd::Variable()};
  }
};

// The permutation that takes received rows from source-major order (source rank, then its local
// expert) to expert-major order (local expert, then source rank), and its inverse, from the
// [ranks, per_rank] table of rows per source and local expert, on the table's device: no host
// copy of per-row indices, no synchronisation (`total`, the table's sum, is known on the host).
std::pair<at::Tensor, at::Tensor> expert_major_order(const at::Tensor& table, int64_t total) {
  const auto flat = table.reshape(-1);
  // Where each (source, expert) block starts among the received rows.
  const auto source_start = (at::cumsum(flat, 0) - flat).view(table.sizes());
  // The blocks in expert-major order: their sizes, where each starts in the output and where it
  // came from.
  const auto counts = table.t().reshape(-1);
  const auto output_start = at::cumsum(counts, 0) - counts;
  const auto block =
      at::arange(counts.numel(), table.options()).repeat_interleave(counts, /*dim=*/0, total);
  const auto position = at::arange(total, table.options());
  const auto order = source_start.t().reshape(-1).index_select(0, block) + position -
                     output_start.index_select(0, block);
  auto inverse = at::empty_like(order).scatter_(0, order, position);
  return {order, inverse};
}

class AllToAllDispatcher : public model::ExpertDispatcher {
 public:
  AllToAllDispatcher(ProcessGroup group, int64_t experts)
      : group_(std::move(group)), ranks_(std::max(1, group_.size())), experts_(experts) {}

  at::Tensor dispatch(const at::Tensor& rows, const at::Tensor& counts,
                      const LocalExperts& local) override {
    const int64_t per_rank = experts_ / ranks_;
    // The counts on the rows' device (copied without a synchronisation when they come from the
    // host), exchanged there, then this rank's counts and the exchanged table read to the host
    // together: the layer's one synchronisation.
    at::Tensor device_counts = counts.to(at::kLong).contiguous();
    if (ranks_ == 1) {  // nothing to exchange: the counts to the host, where they may already be
      const auto host = device_counts.to(at::kCPU).contiguous();
      const int64_t* data = host.data_ptr<int64_t>();
      return local(rows, std::vector<int64_t>(data, data + host.numel()));
    }
    if (device_counts.is_cpu() && !rows.is_cpu()) {
      const int64_t* host = device_counts.data_ptr<int64_t>();
      device_counts = model::host_index_tensor(
          std::vector<int64_t>(host, host + device_counts.numel()), rows.device());
    } else {
      device_counts = device_counts.to(rows.device());
    }
    const std::vector<int64_t> blocks(static_cast<std::size_t>(ranks_), per_rank);
    const auto exchanged = all_to_all(group_, device_counts, blocks, blocks);
    const auto both = at::cat({device_counts, exchanged}).to(at::kCPU).contiguous();
    const int64_t* own = both.data_ptr<int64_t>();
    // Each source's rows per local expert: a [ranks, per_rank] table.
    const int64_t* table = own + experts_;
    // Rows per destination.
    std::vector<int64_t> send(static_cast<std::size_t>(ranks_), 0);
    for (int64_t e = 0; e < experts_; ++e) {
      send[static_cast<std::size_t>(e / per_rank)] += own[e];
    }
    std::vector<int64_t> recv(static_cast<std::size_t>(ranks_), 0);
    std::vector<int64_t> local_counts(static_cast<std::size_t>(per_rank), 0);
    for (int64_t src = 0; src < ranks_; ++src) {
      for (int64_t e = 0; e < per_rank; ++e) {
        recv[static_cast<std::size_t>(src)] += table[src * per_rank + e];
        local_counts[static_cast<std::size_t>(e)] += table[src * per_rank + e];
      }
    }
    const auto received = AllToAllRows::apply(rows, reinterpret_cast<int64_t>(&group_), send, recv);

    // Source-major (as received) to expert-major (as the grouped GEMM wants), and back: the
    // permutation computed on the rows' device from the exchanged table (a host-built index of
    // every row cost a pinned copy of up to 24 ms per layer on the GPU).
    const int64_t total = std::accumulate(recv.begin(), recv.end(), int64_t{0});
    const auto [to_expert_major, to_source_major] =
        expert_major_order(exchanged.view({ranks_, per_rank}), total);
    const auto grouped = PermuteRows::apply(received, to_expert_major, to_source_major);
    const auto outputs = local(grouped, local_counts);
    const auto back = PermuteRows::apply(outputs, to_source_major, to_expert_major);
    return AllToAllRows::apply(back, reinterpret_cast<int64_t>(&group_), recv, send);
  }

 private:
  ProcessGroup group_;
  int64_t ranks_;
  int64_t experts_;
};

// The experts' gradients summed over their replicas, ep_dp_replicate x ep_replicate (Replicate's
// bucketed path on that group), for the expert records still replicated over ep_replicate when the
// first step begins: the data-parallel strategy comes after this one and may shard them over
// ep_replicate (FullyShard, which then reduces them itself, all-reducing over ep_dp_replicate).
class ExpertReplicaSync : public GradientSync {
 public:
  ExpertReplicaSync(ParallelModel& model, GradientTiming timing, ProcessGroup replicas)
      : model_(model), timing_(timing), replicas_(std::move(replicas)) {}

  void begin_step() override { inner().begin_step(); }
  void before_forward(int microbatch, int microbatches) override {
    inner().before_forward(microbatch, microbatches);
  }
  void before_backward(int microbatch, int microbatches) override {
    inner().before_backward(microbatch, microbatches);
  }
  void finish() override { inner().finish(); }

 private:
  GradientSync& inner() {
    if (inner_) {
      return *inner_;
    }
    std::vector<at::Tensor> replicated;
    for (const auto& record : model_.parameters()) {
      if (record.domain != MeshDomain::expert) {
        continue;
      }
      for (std::size_t i = 0; i < record.dims.size(); ++i) {
        if (record.dims[i] == "ep_replicate" &&
            std::holds_alternative<::d9d::Replicate>(record.placements[i])) {
          replicated.push_back(record.local);
        }
      }
    }
    inner_ = replicated.empty() ? std::make_unique<GradientSync>()
                                : make_replicate_sync(replicas_, std::move(replicated),
                                                      model_.options().bucket_bytes, timing_);
    return *inner_;
  }

  ParallelModel& model_;
  GradientTiming timing_;
  ProcessGroup replicas_;
  std::unique_ptr<GradientSync> inner_;
};

}  // namespace

void apply_expert_parallel(ParallelModel& model, const ExpertParallelSettings& settings) {
  const auto& mesh = model.mesh();
  const auto shard_group = mesh.group(MeshDomain::expert, "ep_shard");
  const int64_t ranks = mesh.size(MeshDomain::expert, "ep_shard");
  const int64_t rank = mesh.coordinate(MeshDomain::expert, "ep_shard");
  auto& records = model.mutable_parameters();
  bool any = false;
  for (const auto& module : model.modules()) {
    for (const auto& item : module->named_modules()) {
      auto experts = std::dynamic_pointer_cast<model::GroupedExpertsImpl>(item.value());
      if (!experts) {
        continue;
      }
      any = true;
      const std::string prefix = item.key().empty() ? std::string() : item.key() + ".";
      const int64_t count = experts->num_experts();
      if (settings.num_experts > 0 && count != settings.num_experts) {
        throw ConfigError(
            "d9d::parallel::ExpertParallel<" + std::to_string(settings.num_experts) +
            ">: the model's \"" + prefix + "\" has " + std::to_string(count) +
            " experts. Fix: state the model's count in the policy, or use ExpertParallel<>");
      }
      if (count % ranks != 0) {
        throw ConfigError("d9d::parallel::ExpertParallel: \"mesh.ep\" = " + std::to_string(ranks) +
                          " does not divide the " + std::to_string(count) + " experts of \"" +
                          prefix + "\". Fix: set \"mesh.ep\" to a divisor of " +
                          std::to_string(count));
      }
      const int64_t per_rank = count / ranks;
      for (const auto& item : experts->named_parameters(/*recurse=*/false)) {
        const std::string& name = item.key();
        auto param = item.value();
        const auto whole = param.sizes().vec();
        {
          const at::NoGradGuard no_grad;
          param.set_data(param.detach().narrow(0, rank * per_rank, per_rank).clone());
        }
        bool trained = false;
        for (auto& record : records) {
          if (record.name == prefix + name) {
            record.domain = MeshDomain::expert;
            record.dims = {"ep_dp_replicate", "ep_replicate", "ep_shard"};
            record.placements = {::d9d::Replicate{}, ::d9d::Replicate{}, ::d9d::Shard{0}};
            trained = true;
          }
        }
        // A frozen expert weight (LoRA on the experts, or a Freeze) is split all the same: its
        // layout is recorded so that exports and checkpoints gather it.
        if (!trained) {
          model.mutable_frozen_split_parameters().push_back(ParameterRecord{
              .name = prefix + name,
              .local = param,
              .global_shape = whole,
              .domain = MeshDomain::expert,
              .dims = {"ep_dp_replicate", "ep_replicate", "ep_shard"},
              .placements = {::d9d::Replicate{}, ::d9d::Replicate{}, ::d9d::Shard{0}}});
        }
      }
      experts->set_expert_parallel(rank * per_rank,
                                   std::make_shared<AllToAllDispatcher>(shard_group, count));
    }
  }
  if (!any) {
    throw std::invalid_argument(
        "d9d::parallel::ExpertParallel: the model has no d9d::model::GroupedExperts to shard. "
        "Fix: use d9d::parallel::NoExpertParallel for dense models");
  }
  model.add_norm_dims({"ep_shard"}, MeshDomain::expert);
  // Every replica of this rank's experts (a group of one dimension where the other has one rank).
  auto replicas = mesh.size(MeshDomain::expert, "ep_dp_replicate") == 1
                      ? mesh.group(MeshDomain::expert, "ep_replicate")
                  : mesh.size(MeshDomain::expert, "ep_replicate") == 1
                      ? mesh.group(MeshDomain::expert, "ep_dp_replicate")
                      : mesh.group(MeshDomain::expert,
                                   std::vector<std::string>{"ep_dp_replicate", "ep_replicate"});
  model.add_sync(std::make_unique<ExpertReplicaSync>(model, settings.timing, std::move(replicas)));
}

}  // namespace d9d::parallel::detail
