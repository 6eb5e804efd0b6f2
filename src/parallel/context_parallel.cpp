// d9d/parallel/context_parallel.cpp — ContextParallel: the sequence split over the batch domain's
// cp ranks (load-balanced chunks, d9d/model/context_parallel.hpp), the keys and values brought to
// every rank by an all-gather or around a ring, with their autograd functions.
//
// All-gather: each layer's K and V ([B, kv_heads, 2 L, dim] each) are all-gathered once, every
// rank's K and V a tensor of its own (GatherKv); backward reduce-scatters their gradients (each
// rank's block gets the sum of what every rank's queries gave it). Ring: K and V are passed to the
// next rank cp − 1 times (send to r + 1, receive from r − 1, in one batch; PassKv), each hop's
// block visited before the next; backward passes the gradients the other way round. Both visit the
// same blocks, so the result and the gradients are the same; they differ in what is in flight and
// held (all of K/V at once, or one block). The parameters are the same on every cp rank (broadcast
// here) and their gradients, of different tokens, are summed over cp by the data-parallel strategy
// (Replicate: data_parallel_group; FullyShard shards over dp_shard x cp_shard and reduce-scatters
// there).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

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

// Every rank's k and v, as 2 R outputs (k of ranks 0..R-1, then their v): separate tensors, so
// each gets its own gradient. Backward: each rank's gradients summed over the group and this
// rank's kept (a reduce-scatter of the stacked gradients; a rank's block nobody attended to
// contributes zeros).
struct GatherKv : torch::autograd::Function<GatherKv> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& k, const at::Tensor& v,
                               int64_t group) {
    ctx->saved_data["group"] = group;
    variable_list out = all_gather(group_at(group), k.contiguous());
    auto values = all_gather(group_at(group), v.contiguous());
    out.insert(out.end(), values.begin(), values.end());
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    const std::size_t ranks = grads.size() / 2;
    at::Tensor like;
    for (const auto& grad : grads) {
      if (grad.defined()) {
        like = grad;
        break;
      }
    }
    const auto reduce = [&](std::size_t first) {
      std::vector<at::Tensor> parts;
      parts.reserve(ranks);
      for (std::size_t r = 0; r < ranks; ++r) {
        const auto& grad = grads[first + r];
        parts.push_back(grad.defined() ? grad : at::zeros_like(like));
      }
      return reduce_scatter(group, at::stack(parts), 0).squeeze(0);
    };
    return {reduce(0), reduce(ranks), at::Tensor()};
  }
};

// `tensors` to the next rank of the ring and the previous rank's back (`forward` true); or the
// reverse. One batch of point-to-point operations.
std::vector<at::Tensor> shift(const ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                              bool forward) {
  const int size = group.size();
  const int next = (group.rank() + 1) % size;
  const int previous = (group.rank() + size - 1) % size;
  std::vector<at::Tensor> received;
  std::vector<P2POp> ops;
  for (const auto& x : tensors) {
    received.push_back(at::empty(x.sizes(), x.options().device(group.device())));
    ops.push_back({.kind = P2POp::Kind::send,
                   .tensor = x.contiguous(),
                   .peer = forward ? next : previous,
                   .tag = static_cast<int>(ops.size())});
    ops.push_back({.kind = P2POp::Kind::recv,
                   .tensor = received.back(),
                   .peer = forward ? previous : next,
                   .tag = static_cast<int>(ops.size() - 1)});
  }
  batch_isend_irecv(group, ops).wait();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    received[i] = received[i].to(tensors[i].device());
  }
  return received;
}

// One hop of the ring for k and v: forward they go to rank r + 1 and rank r − 1's arrive;
// backward their gradients go back to r − 1 and r + 1's arrive.
struct PassKv : torch::autograd::Function<PassKv> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& k, const at::Tensor& v,
                               int64_t group) {
    ctx->saved_data["group"] = group;
    return shift(group_at(group), {k, v}, /*forward=*/true);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    const auto& like = grads[0].defined() ? grads[0] : grads[1];
    auto back = shift(group,
                      {grads[0].defined() ? grads[0] : at::zeros_like(like),
                       grads[1].defined() ? grads[1] : at::zeros_like(like)},
                      /*forward=*/false);
    return {back[0], back[1], at::Tensor()};
  }
};

// A collective in flight on `input`: waits, then gives `output` on `device`. The input stays
// referenced until the wait: the current stream then follows the collective, so the allocator may
// reuse it.
model::ContextParallelGroup::Pending waiting(c10::intrusive_ptr<c10d::Work> work, at::Tensor input,
                                             at::Tensor output, c10::Device device) {
  return [work = std::move(work), input = std::move(input), output = std::move(output), device] {
    work->wait();
    (void)input;
    return output.to(device);
  };
}

class Group final : public model::ContextParallelGroup {
 public:
  Group(ProcessGroup group, bool ring) : group_(std::move(group)), ring_(ring) {}
  [[nodiscard]] int rank() const override { return group_.size() > 1 ? group_.rank() : 0; }
  [[nodiscard]] int size() const override { return std::max(1, group_.size()); }

  [[nodiscard]] bool gathers_at_once() const override { return !ring_; }

  [[nodiscard]] Pending start_gather(const at::Tensor& x) const override {
    const int ranks = size();
    if (ranks == 1) {
      return [x] { return x.unsqueeze(0); };
    }
    // Flat buffers, as every backend's base collectives take them.
    auto input = x.contiguous().to(group_.device());
    std::vector<int64_t> sizes{ranks};
    sizes.insert(sizes.end(), input.sizes().begin(), input.sizes().end());
    auto output = at::empty({ranks * input.numel()}, input.options());
    auto flat = input.view({-1});
    auto work = group_.backend()->_allgather_base(output, flat);
    return waiting(work, input, output.view(sizes), x.device());
  }

  [[nodiscard]] Pending start_reduce_scatter(const at::Tensor& x) const override {
    if (size() == 1) {
      return [x] { return x.select(0, 0); };
    }
    auto input = x.contiguous().to(group_.device());
    auto output = at::empty({input.numel() / size()}, input.options());
    auto flat = input.view({-1});
    auto work = group_.backend()->_reduce_scatter_base(output, flat);
    return waiting(work, input, output.view(input.sizes().slice(1)), x.device());
  }

  void for_each_kv(const at::Tensor& k, const at::Tensor& v,
                   const KvVisitor& visit) const override {
    const int ranks = size();
    if (ranks == 1) {
      visit(0, k, v);
      return;
    }
    if (!ring_) {
      const auto all = GatherKv::apply(k, v, address_of(group_));
      for (int hop = 0; hop < ranks; ++hop) {
        const auto source = static_cast<std::size_t>((rank() + hop) % ranks);
        visit(static_cast<int>(source), all[source], all[static_cast<std::size_t>(ranks) + source]);
      }
      return;
    }
    at::Tensor keys = k;
    at::Tensor values = v;
    for (int hop = 0; hop < ranks; ++hop) {
      visit((rank() + ranks - hop) % ranks, keys, values);
      if (hop + 1 < ranks) {
        auto next = PassKv::apply(keys, values, address_of(group_));
        keys = next[0];
        values = next[1];
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
  // The sequence is split over the batch domain's cp = cp_shard x cp_replicate; cp_replicate only
  // tells FullyShard not to shard over those ranks (it all-reduces over them instead).
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
        "implement d9d::model::ContextParallelModel; the dense Qwen3ForCausalLM and Qwen3Stage do, "
        "Qwen3-MoE does not yet). Fix: use d9d::parallel::NoContextParallel");
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
