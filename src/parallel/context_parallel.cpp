// d9d/parallel/context_parallel.cpp — ContextParallel: the sequence split over the batch domain's
// cp ranks (load-balanced chunks, d9d/model/context_parallel.hpp), the keys and values brought to
// every rank by an all-gather or around a ring, with their autograd functions.
//
// All-gather: each layer's K and V (stacked, [2, B, kv_heads, 2 L, dim]) are all-gathered once;
// backward reduce-scatters their gradients (each rank's block gets the sum of what every rank's
// queries gave it). Ring: the stacked block is passed to the next rank cp − 1 times (send to
// r + 1, receive from r − 1, together), each hop's block attended before the next; backward passes
// the gradients the other way round. Both visit the same blocks, so the result and the gradients
// are the same; they differ in what is in flight and held (all of K/V at once, or one block).
// The parameters are the same on every cp rank (broadcast here) and their gradients, of different
// tokens, are summed over cp by the data-parallel strategy (Replicate: data_parallel_group;
// FullyShard shards over dp_shard x cp_shard and reduce-scatters there).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/core/collectives.hpp>
#include <d9d/model/context_parallel.hpp>
#include <d9d/parallel/parallelize.hpp>

namespace d9d::parallel::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// NOLINTBEGIN(performance-no-int-to-ptr): the group outlives the model's graphs (the model holds
// it)
const ProcessGroup& group_at(int64_t address) {
  return *reinterpret_cast<const ProcessGroup*>(address);
}
int64_t address_of(const ProcessGroup& group) { return reinterpret_cast<int64_t>(&group); }
// NOLINTEND(performance-no-int-to-ptr)

// Every rank's x concatenated along dim 0; backward: the gradient summed over the group, this
// rank's rows kept (reduce-scatter).
struct GatherBlocks : torch::autograd::Function<GatherBlocks> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return all_gather_cat(group_at(group), x.contiguous(), 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    return {reduce_scatter(group, grads[0].contiguous(), 0), at::Tensor()};
  }
};

// x to the next rank of the ring, the previous rank's x back (`forward` true); or the reverse.
at::Tensor shift(const ProcessGroup& group, const at::Tensor& x, bool forward) {
  const int size = group.size();
  const int next = (group.rank() + 1) % size;
  const int previous = (group.rank() + size - 1) % size;
  auto received = at::empty_like(x, x.options().device(group.device()));
  batch_isend_irecv(
      group,
      {{.kind = P2POp::Kind::send, .tensor = x.contiguous(), .peer = forward ? next : previous},
       {.kind = P2POp::Kind::recv, .tensor = received, .peer = forward ? previous : next}})
      .wait();
  return received.to(x.device());
}

// One hop of the ring: forward x goes to rank r + 1 and rank r − 1's arrives; backward the
// gradient goes back to r − 1 and r + 1's arrives.
struct PassOn : torch::autograd::Function<PassOn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return shift(group_at(group), x, /*forward=*/true);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    return {shift(group, grads[0], /*forward=*/false), at::Tensor()};
  }
};

class Group final : public model::ContextParallelGroup {
 public:
  Group(ProcessGroup group, bool ring) : group_(std::move(group)), ring_(ring) {}
  [[nodiscard]] int rank() const override { return group_.size() > 1 ? group_.rank() : 0; }
  [[nodiscard]] int size() const override { return std::max(1, group_.size()); }

  void for_each_kv(const at::Tensor& k, const at::Tensor& v,
                   const KvVisitor& visit) const override {
    auto block = at::stack({k, v});
    if (size() == 1) {
      visit(0, block[0], block[1]);
      return;
    }
    if (!ring_) {
      const auto all = GatherBlocks::apply(block, address_of(group_));
      for (int hop = 0; hop < size(); ++hop) {
        const int source = (rank() + hop) % size();
        visit(source, all[2 * source], all[2 * source + 1]);
      }
      return;
    }
    for (int hop = 0; hop < size(); ++hop) {
      visit((rank() + size() - hop) % size(), block[0], block[1]);
      if (hop + 1 < size()) {
        block = PassOn::apply(block, address_of(group_));
      }
    }
  }

 private:
  ProcessGroup group_;
  bool ring_;
};

}  // namespace

std::shared_ptr<const model::ContextParallelGroup> make_context_parallel_group(
    const ProcessGroup& group, bool ring) {
  return std::make_shared<const Group>(group, ring);
}

ProcessGroup data_parallel_group(const DeviceMesh& mesh) {
  if (mesh.size(MeshDomain::batch, "cp") > 1) {
    return mesh.group(MeshDomain::batch, std::vector<std::string>{"dp", "cp"});
  }
  return mesh.group(MeshDomain::batch, "dp");
}

void apply_context_parallel(ParallelModel& model, bool ring) {
  const auto cp = model.mesh().group(MeshDomain::batch, "cp");
  const auto group = make_context_parallel_group(cp, ring);
  int found = 0;
  for (const auto& module : model.modules()) {
    if (auto* target = dynamic_cast<model::ContextParallelModel*>(module.get())) {
      target->set_context_parallel(group);
      ++found;
    }
  }
  if (found == 0) {
    throw std::invalid_argument(
        "d9d::parallel::ContextParallel: the model does not split its sequence (it does not "
        "implement d9d::model::ContextParallelModel; the dense Qwen3ForCausalLM does, Qwen3-MoE "
        "and pipeline stages do not yet). Fix: use d9d::parallel::NoContextParallel");
  }
  // The same parameters on every cp rank, recorded as replicated over cp (one rank of them
  // writes checkpoints; FullyShard folds cp_shard into its shards).
  const at::NoGradGuard no_grad;
  for (auto& record : model.mutable_parameters()) {
    if (cp.size() > 1) {
      record.local.copy_(broadcast(cp, record.local.detach(), 0));
    }
    if (record.domain == MeshDomain::regular) {
      for (const char* dim : {"cp_shard", "cp_replicate"}) {
        record.dims.emplace_back(dim);
        record.placements.emplace_back(::d9d::Replicate{});
      }
    }
  }
}

}  // namespace d9d::parallel::detail
