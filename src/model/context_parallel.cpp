// d9d/model/context_parallel.cpp — the load-balanced chunks of context parallelism and the
// attention of a rank's chunks over every rank's keys, block by block with an online-softmax merge.
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/model/context_parallel.hpp>
#include <d9d/model/layers.hpp>

namespace d9d::model {
namespace {

// The score of a hidden key: finite, so a block whose keys a query cannot see at all (packed
// documents) has a finite log-sum-exp whose weight in the merge is exp(-1e30) = 0, and autograd
// meets no inf - inf.
constexpr double kHidden = -1e30;

// One block's attention: the softmax output [B, heads, L, dim] and log-sum-exp [B, heads, L] of
// queries q [B, heads, L, dim] over keys k, v [B, kv_heads, S, dim], in `acc`. `keep` [B, 1, L, S]
// (bool) says which keys each query sees; undefined: all (or the causal triangle when `causal`).
struct Block {
  at::Tensor out;
  at::Tensor lse;
};

Block attend_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& keep, bool causal, at::ScalarType acc) {
  const int64_t batch = q.size(0);
  const int64_t heads = q.size(1);
  const int64_t rows = q.size(2);
  const int64_t dim = q.size(3);
  const int64_t kv_heads = k.size(1);
  const int64_t keys = k.size(2);
  // Grouped-query attention as SDPA's enable_gqa: query head h reads KV head h / (heads / kv).
  const auto grouped = q.to(acc).reshape({batch, kv_heads, heads / kv_heads, rows, dim});
  auto scores = at::matmul(grouped, k.to(acc).unsqueeze(2).transpose(-1, -2)) *
                (1.0 / std::sqrt(static_cast<double>(dim)));  // [B, kv, group, L, S]
  at::Tensor mask;
  if (keep.defined()) {
    mask = keep.unsqueeze(2);
  } else if (causal) {
    mask = at::ones({rows, keys}, q.options().dtype(at::kBool)).tril();
  }
  if (mask.defined()) {
    scores = scores.masked_fill(mask.logical_not(), kHidden);
  }
  auto lse = at::logsumexp(scores, -1, /*keepdim=*/true);
  const auto out = at::matmul(at::exp(scores - lse), v.to(acc).unsqueeze(2));
  return {out.reshape({batch, heads, rows, dim}), lse.reshape({batch, heads, rows})};
}

// The blocks of one query chunk merged: the softmax over the union of their keys. Each block's
// output (in any dtype) is weighted by its share of the whole, exp(lse_n - lse), and summed in the
// log-sum-exps' dtype; returns that sum and the whole log-sum-exp [B, heads, L]. Out of place, so
// autograd differentiates it on the composed path.
Block merge(const std::vector<Block>& blocks) {
  std::vector<at::Tensor> lses;
  lses.reserve(blocks.size());
  for (const auto& block : blocks) {
    lses.push_back(block.lse);
  }
  const auto lse = at::logsumexp(at::stack(lses), 0);
  at::Tensor out;
  for (const auto& block : blocks) {
    const auto weight = at::exp(block.lse - lse).unsqueeze(-1);
    out = out.defined() ? at::addcmul(out, block.out, weight)
                        : block.out.to(lse.scalar_type()) * weight;
  }
  return {out, lse};
}

// ---- the fused path: the backend's attention kernel per block -----------------------------------
//
// Forward: each block's output and log-sum-exp from the kernel (on CUDA cuDNN's fused attention,
// or FlashAttention-2 when cuDNN's SDPA is disabled; on CPU ATen's flash kernel), merged as above.
// Backward: the kernel's backward of each block with the merged output and log-sum-exp (so its
// probabilities are the block's share of the whole softmax: exp(s - lse)), which gives exactly
// the block's part of the gradients of q, k and v — the recipe of ring attention. Nothing of size
// L x S is kept or materialised.

enum class Kernel { cpu_flash, cuda_flash, cuda_cudnn };

Kernel kernel_for(const at::Tensor& q) {
  if (!q.is_cuda()) {
    return Kernel::cpu_flash;
  }
  return at::globalContext().userEnabledCuDNNSDP() ? Kernel::cuda_cudnn : Kernel::cuda_flash;
}

// What a block's forward leaves for its backward besides q, k, v (the CUDA kernels' state).
struct KernelState {
  at::Tensor seed, offset;
};

struct KernelBlock {
  at::Tensor out;  // [B, heads, L, dim], q's dtype
  at::Tensor lse;  // the kernel's layout ([B, heads, L], or [B, heads, L, 1] from cuDNN)
  KernelState state;
};

KernelBlock kernel_forward(Kernel kernel, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, bool causal) {
  switch (kernel) {
    case Kernel::cuda_cudnn: {
      auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt,
                                                       /*compute_log_sumexp=*/true, 0.0, causal);
      return {std::get<0>(r), std::get<1>(r), {std::get<6>(r), std::get<7>(r)}};
    }
    case Kernel::cuda_flash: {
      auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal);
      return {std::get<0>(r), std::get<1>(r), {std::get<6>(r), std::get<7>(r)}};
    }
    case Kernel::cpu_flash:
      break;
  }
  auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
  return {std::get<0>(r), std::get<1>(r), {}};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel_backward(
    Kernel kernel, const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
    const KernelState& state) {
  switch (kernel) {
    case Kernel::cuda_cudnn:
      return at::_scaled_dot_product_cudnn_attention_backward(
          grad, q, k, v, out, lse, state.seed, state.offset, at::Tensor(), at::Tensor(),
          at::Tensor(), q.size(2), k.size(2), 0.0, causal);
    case Kernel::cuda_flash:
      return at::_scaled_dot_product_flash_attention_backward(
          grad, q, k, v, out, lse, at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0, causal,
          state.seed, state.offset);
    case Kernel::cpu_flash:
      break;
  }
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0,
                                                                  causal);
}

// One block of the fused path: query chunk `chunk` (0 or 1 of this rank's two) over chunk `part`
// (0 or 1) of the keys of the n-th rank visited (`source`); causal on the diagonal.
struct Pair {
  int64_t chunk = 0;
  int64_t source = 0;
  int64_t part = 0;
  bool causal = false;
};

std::vector<int64_t> encode(const std::vector<Pair>& pairs) {
  std::vector<int64_t> out;
  out.reserve(4 * pairs.size());
  for (const auto& p : pairs) {
    out.insert(out.end(), {p.chunk, p.source, p.part, p.causal ? 1 : 0});
  }
  return out;
}

std::vector<Pair> decode(const std::vector<int64_t>& flat) {
  std::vector<Pair> pairs;
  pairs.reserve(flat.size() / 4);
  for (std::size_t i = 0; i + 3 < flat.size(); i += 4) {
    pairs.push_back({flat[i], flat[i + 1], flat[i + 2], flat[i + 3] != 0});
  }
  return pairs;
}

// This rank's queries q [B, heads, 2 L, dim] over the visited ranks' keys and values
// `kv` = {k_0, v_0, k_1, v_1, ...} ([B, kv_heads, 2 L, dim] each), block by block as `pairs` say.
// One function for both query chunks and whole key blocks, so each visited tensor gets one
// gradient (no zero-filled view gradients per block).
struct FusedContextAttention : torch::autograd::Function<FusedContextAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            at::TensorList kv, const std::vector<int64_t>& flat_pairs) {
    const auto kernel = kernel_for(q);
    const auto acc = at::promote_types(q.scalar_type(), at::kFloat);
    const int64_t chunk = q.size(2) / 2;
    const std::vector<int64_t> rows{q.size(0), q.size(1), chunk};
    const auto pairs = decode(flat_pairs);
    std::vector<at::Tensor> outs;
    std::vector<at::Tensor> lses;
    std::vector<at::Tensor> saved_states;
    for (int64_t i = 0; i < 2; ++i) {
      const auto query = q.narrow(2, i * chunk, chunk);
      std::vector<KernelBlock> blocks;
      for (const auto& p : pairs) {
        if (p.chunk == i) {
          const auto slot = static_cast<std::size_t>(2 * p.source);
          blocks.push_back(kernel_forward(kernel, query, kv[slot].narrow(2, p.part * chunk, chunk),
                                          kv[slot + 1].narrow(2, p.part * chunk, chunk), p.causal));
          saved_states.push_back(blocks.back().state.seed);
          saved_states.push_back(blocks.back().state.offset);
        }
      }
      if (blocks.size() == 1) {
        outs.push_back(blocks.front().out);
        lses.push_back(blocks.front().lse);
        continue;
      }
      std::vector<Block> parts;
      parts.reserve(blocks.size());
      for (const auto& block : blocks) {
        parts.push_back({block.out, block.lse.reshape(rows).to(acc)});
      }
      const auto merged = merge(parts);
      outs.push_back(merged.out.to(q.scalar_type()));
      // In the kernel's layout and dtype, for its backward.
      lses.push_back(merged.lse.reshape(blocks.front().lse.sizes()).contiguous());
    }
    std::vector<at::Tensor> saved{q, outs[0], outs[1], lses[0], lses[1]};
    saved.insert(saved.end(), kv.begin(), kv.end());
    saved.insert(saved.end(), saved_states.begin(), saved_states.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["pairs"] = flat_pairs;
    ctx->saved_data["kernel"] = static_cast<int64_t>(kernel);
    return at::cat(outs, 2);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto pairs = decode(ctx->saved_data["pairs"].toIntVector());
    const auto kernel = static_cast<Kernel>(ctx->saved_data["kernel"].toInt());
    const auto& q = saved[0];
    const int64_t chunk = q.size(2) / 2;
    const std::size_t tensors = saved.size() - 5 - 2 * pairs.size();  // the kv list
    std::vector<at::Tensor> grad_kv(tensors);
    std::vector<at::Tensor> grad_q(2);
    std::size_t state = 5 + tensors;
    for (int64_t i = 0; i < 2; ++i) {
      const auto query = q.narrow(2, i * chunk, chunk);
      const auto grad = grads[0].narrow(2, i * chunk, chunk).contiguous();
      const auto& out = saved[static_cast<std::size_t>(1 + i)];
      const auto& lse = saved[static_cast<std::size_t>(3 + i)];
      for (const auto& p : pairs) {
        if (p.chunk != i) {
          continue;
        }
        const KernelState kernel_state{saved[state], saved[state + 1]};
        state += 2;
        const auto slot = static_cast<std::size_t>(2 * p.source);
        const auto& keys = saved[5 + slot];
        const auto& values = saved[6 + slot];
        auto [gq, gk, gv] = kernel_backward(
            kernel, grad, query, keys.narrow(2, p.part * chunk, chunk),
            values.narrow(2, p.part * chunk, chunk), out, lse, p.causal, kernel_state);
        auto& dq = grad_q[static_cast<std::size_t>(i)];
        dq = dq.defined() ? dq.add_(gq) : gq;
        for (const auto& [index, part] : {std::pair{slot, gk}, std::pair{slot + 1, gv}}) {
          auto& target = grad_kv[index];
          if (!target.defined()) {
            target = at::zeros_like(saved[5 + index]);
          }
          target.narrow(2, p.part * chunk, chunk).add_(part);
        }
      }
    }
    torch::autograd::variable_list result{at::cat(grad_q, 2)};
    result.insert(result.end(), grad_kv.begin(), grad_kv.end());
    result.emplace_back();  // pairs
    return result;
  }
};

// ---- the overlapped path: every rank's keys at once (all_gather) --------------------------------
//
// This rank's queries q [B, heads, 2 L, dim] (chunks c_0 < c_1 of the sequence) over its own keys
// k, v [B, kv_heads, 2 L, dim] and every other rank's. Per query chunk c two blocks: the diagonal
// (its own keys, causal) and the prefix (keys of chunks 0 .. c - 1 in sequence order, one kernel
// call; none for c = 0), merged by log-sum-exp. Forward starts the gather, attends the diagonals
// while it runs, then the prefixes. Backward gathers again (behind the early chunk's diagonal
// block), runs the prefix blocks, starts the reduce-scatter of their key gradients (laid out rank
// by rank, as gathered), runs the late chunk's diagonal block while it runs, and adds. Tensors stay
// in the projections' layout, [B, T, heads, dim] (the kernels take the head transpose as a view): K
// and V travel as one contiguous buffer, and the output is written in place for the output
// projection, with no layout copies.

// NOLINTBEGIN(performance-no-int-to-ptr): the group outlives the graphs (the layer holds it)
const ContextParallelGroup& group_at(int64_t address) {
  return *reinterpret_cast<const ContextParallelGroup*>(address);
}
int64_t address_of(const ContextParallelGroup& group) { return reinterpret_cast<int64_t>(&group); }
// NOLINTEND(performance-no-int-to-ptr)

// Where chunk `chunk` of the sequence lies among the gathered ones: its rank and its part (0 or 1)
// of that rank's two.
std::pair<int64_t, int64_t> chunk_home(int64_t chunk, int size) {
  return chunk < size ? std::pair{chunk, int64_t{0}}
                      : std::pair{int64_t{2} * size - 1 - chunk, int64_t{1}};
}

// Chunks 0 .. count - 1 in sequence order of `gathered` [size, B, 2 L, kv, dim] (every rank's
// keys or values): [B, count L, kv, dim].
at::Tensor prefix_of(const at::Tensor& gathered, int64_t count, int size) {
  const int64_t chunk = gathered.size(2) / 2;
  std::vector<at::Tensor> parts;
  parts.reserve(static_cast<std::size_t>(count));
  for (int64_t c = 0; c < count; ++c) {
    const auto [rank, part] = chunk_home(c, size);
    parts.push_back(gathered.select(0, rank).narrow(1, part * chunk, chunk));
  }
  return at::cat(parts, 1);
}

// The two blocks of a query chunk merged into `dest` ([B, heads, L, dim], q's dtype): each
// weighted by its share of the whole softmax, exp(lse_n - lse), summed in `acc`. Returns the whole
// log-sum-exp in the kernel's layout.
at::Tensor merge_into(const at::Tensor& dest, const KernelBlock& a, const KernelBlock& b,
                      at::ScalarType acc) {
  const std::vector<int64_t> rows{dest.size(0), dest.size(1), dest.size(2)};
  const auto la = a.lse.reshape(rows).to(acc);
  const auto lb = b.lse.reshape(rows).to(acc);
  const auto lse = at::logaddexp(la, lb);
  auto sum = at::mul(a.out, at::exp(la - lse).unsqueeze(-1));  // in acc
  sum.addcmul_(b.out, at::exp(lb - lse).unsqueeze(-1));
  dest.copy_(sum);
  return lse.reshape(a.lse.sizes()).contiguous();
}

// q [B, heads, 2 L, dim], k and v [B, kv, 2 L, dim] (views of [B, 2 L, ..., dim]). Returns the
// output as [B, 2 L, heads, dim] (context_attention gives its head transpose).
struct GatheredContextAttention : torch::autograd::Function<GatheredContextAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, int64_t group_address) {
    const auto& group = group_at(group_address);
    const auto kernel = kernel_for(q);
    const auto acc = at::promote_types(q.scalar_type(), at::kFloat);
    const int64_t chunk = q.size(2) / 2;
    const auto [c0, c1] = context_chunks(group.rank(), group.size());
    const std::vector<int64_t> mine{c0, c1};
    const auto pending = group.start_gather(at::stack({k.transpose(1, 2), v.transpose(1, 2)}));
    std::vector<KernelBlock> diagonal;
    for (int64_t i = 0; i < 2; ++i) {
      diagonal.push_back(kernel_forward(kernel, q.narrow(2, i * chunk, chunk),
                                        k.narrow(2, i * chunk, chunk),
                                        v.narrow(2, i * chunk, chunk), /*causal=*/true));
    }
    const auto all = pending();  // [size, 2, B, 2 L, kv, dim]
    // The later chunk's prefix holds the earlier one's.
    const auto keys = prefix_of(all.select(1, 0), c1, group.size()).transpose(1, 2);
    const auto values = prefix_of(all.select(1, 1), c1, group.size()).transpose(1, 2);
    auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
    std::vector<at::Tensor> lses;
    std::vector<at::Tensor> saved_states;
    for (std::size_t i = 0; i < 2; ++i) {
      const auto offset = static_cast<int64_t>(i) * chunk;
      const auto dest = out.narrow(1, offset, chunk).transpose(1, 2);
      auto& own = diagonal[i];
      saved_states.insert(saved_states.end(), {own.state.seed, own.state.offset});
      const int64_t c = mine[i];
      if (c == 0) {
        dest.copy_(own.out);
        lses.push_back(own.lse);
        saved_states.insert(saved_states.end(), {at::Tensor(), at::Tensor()});
        continue;
      }
      const auto before =
          kernel_forward(kernel, q.narrow(2, offset, chunk), keys.narrow(2, 0, c * chunk),
                         values.narrow(2, 0, c * chunk), /*causal=*/false);
      saved_states.insert(saved_states.end(), {before.state.seed, before.state.offset});
      lses.push_back(merge_into(dest, before, own, acc));
    }
    // Every rank's keys are gathered again in backward rather than kept: held from forward to
    // backward they would cost (2 cp - 1) / (2 cp) of the whole sequence's K and V per layer.
    std::vector<at::Tensor> saved{q, k, v, out, lses[0], lses[1]};
    saved.insert(saved.end(), saved_states.begin(), saved_states.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["group"] = group_address;
    ctx->saved_data["kernel"] = static_cast<int64_t>(kernel);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Saved saved(ctx, grads[0]);
    const auto& k = saved.k;
    const auto& v = saved.v;
    auto grad_q = at::empty({saved.q.size(0), saved.q.size(2), saved.q.size(1), saved.q.size(3)},
                            saved.q.options());
    // The gather runs behind the early chunk's diagonal block.
    const auto gathering =
        saved.group->start_gather(at::stack({k.transpose(1, 2), v.transpose(1, 2)}));
    auto early = saved.diagonal(0);
    saved.rows(grad_q, 0).copy_(early.dq);
    const auto all = gathering();  // [size, 2, B, 2 L, kv, dim]
    auto grad_kv = at::zeros_like(all);
    const auto late_prefix_dq = saved.prefixes(all, grad_kv, grad_q);
    // The reduce-scatter runs behind the late chunk's diagonal block.
    const auto summing = saved.group->start_reduce_scatter(grad_kv);
    auto late = saved.diagonal(1);
    auto dest = saved.rows(grad_q, 1);
    at::add_out(dest, late_prefix_dq, late.dq);
    const auto summed = summing();  // [2, B, 2 L, kv, dim]
    const std::vector<Grads> own{early, late};
    for (std::size_t i = 0; i < 2; ++i) {
      saved.rows(summed.select(0, 0), i).add_(own[i].dk);
      saved.rows(summed.select(0, 1), i).add_(own[i].dv);
    }
    return {grad_q.transpose(1, 2), summed.select(0, 0).transpose(1, 2),
            summed.select(0, 1).transpose(1, 2), at::Tensor()};
  }

 private:
  struct Grads {
    at::Tensor dq, dk, dv;
  };

  // What forward saved, and the backward passes over it.
  struct Saved {
    Saved(torch::autograd::AutogradContext* ctx, at::Tensor grad_out)
        : tensors(ctx->get_saved_variables()),
          group(&group_at(ctx->saved_data["group"].toInt())),
          kernel(static_cast<Kernel>(ctx->saved_data["kernel"].toInt())),
          q(tensors[0]),
          k(tensors[1]),
          v(tensors[2]),
          out(tensors[3]),
          grad(std::move(grad_out)),
          chunk(q.size(2) / 2) {
      const auto [c0, c1] = context_chunks(group->rank(), group->size());
      mine = {c0, c1};
    }

    // Chunk i of [B, 2 L, heads, dim] as [B, heads, L, dim].
    [[nodiscard]] at::Tensor rows(const at::Tensor& x, std::size_t i) const {
      return x.narrow(1, static_cast<int64_t>(i) * chunk, chunk).transpose(1, 2);
    }
    [[nodiscard]] KernelState state(std::size_t i, std::size_t block) const {
      const std::size_t index = 6 + 4 * i + 2 * block;
      return {tensors[index], tensors[index + 1]};
    }

    // The diagonal block of query chunk i: this rank's own keys, causal.
    [[nodiscard]] Grads diagonal(std::size_t i) const {
      const auto offset = static_cast<int64_t>(i) * chunk;
      auto [dq, dk, dv] = kernel_backward(
          kernel, rows(grad, i), q.narrow(2, offset, chunk), k.narrow(2, offset, chunk),
          v.narrow(2, offset, chunk), rows(out, i), tensors[4 + i], /*causal=*/true, state(i, 0));
      return {dq, dk, dv};
    }

    // The prefix blocks over every rank's keys `all` ([size, 2, B, 2 L, kv, dim]): their key
    // gradients added to `grad_kv` rank by rank, as gathered; the early chunk's query gradient
    // added to `grad_q`, the late chunk's returned.
    at::Tensor prefixes(const at::Tensor& all, const at::Tensor& grad_kv,
                        const at::Tensor& grad_q) const {
      const int size = group->size();
      const auto keys = prefix_of(all.select(1, 0), mine[1], size).transpose(1, 2);
      const auto values = prefix_of(all.select(1, 1), mine[1], size).transpose(1, 2);
      at::Tensor late_dq;
      for (std::size_t i = 0; i < 2; ++i) {
        const int64_t c = mine[i];
        if (c == 0) {
          continue;
        }
        auto [gq, gk, gv] = kernel_backward(
            kernel, rows(grad, i), q.narrow(2, static_cast<int64_t>(i) * chunk, chunk),
            keys.narrow(2, 0, c * chunk), values.narrow(2, 0, c * chunk), rows(out, i),
            tensors[4 + i], /*causal=*/false, state(i, 1));
        if (i == 0) {
          rows(grad_q, 0).add_(gq);
        } else {
          late_dq = gq;
        }
        for (int64_t n = 0; n < c; ++n) {
          const auto [rank, part] = chunk_home(n, size);
          const auto home = grad_kv.select(0, rank);
          home.select(0, 0)
              .narrow(1, part * chunk, chunk)
              .add_(gk.transpose(1, 2).narrow(1, n * chunk, chunk));
          home.select(0, 1)
              .narrow(1, part * chunk, chunk)
              .add_(gv.transpose(1, 2).narrow(1, n * chunk, chunk));
        }
      }
      return late_dq;
    }

    torch::autograd::variable_list tensors;
    const ContextParallelGroup* group;
    Kernel kernel;
    at::Tensor q, k, v, out;
    at::Tensor grad;
    int64_t chunk;
    std::vector<int64_t> mine;
  };
};

// Whether the blocks go through the attention kernels: the fused kernels on, no placement mask
// (packed documents take the composed path), and a dtype the backend's kernel takes.
bool use_kernels(const at::Tensor& q, const at::Tensor& visible) {
  if (!fused_kernels() || visible.defined()) {
    return false;
  }
  if (q.is_cpu()) {
    return true;
  }
  return q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
}

}  // namespace

std::pair<int64_t, int64_t> context_chunks(int rank, int size) {
  return {rank, 2LL * size - 1 - rank};
}

void check_context_length(int64_t tokens, int size) {
  if (tokens % (2LL * size) != 0) {
    throw std::invalid_argument(
        "d9d::parallel::ContextParallel: over cp = " + std::to_string(size) +
        " ranks each sequence is cut into " + std::to_string(2 * size) +
        " chunks (two per rank, for causal load balancing), but it has " + std::to_string(tokens) +
        " tokens. Fix: set \"batch.sequence_length\" to a multiple of " + std::to_string(2 * size));
  }
}

at::Tensor context_shard(const at::Tensor& x, int64_t dim, int rank, int size) {
  check_context_length(x.size(dim), size);
  const int64_t chunk = x.size(dim) / (2LL * size);
  const auto [first, second] = context_chunks(rank, size);
  return at::cat({x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)}, dim);
}

at::Tensor context_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& visible, const ContextParallelGroup& group) {
  const int64_t chunk = q.size(2) / 2;
  const auto acc = at::promote_types(q.scalar_type(), at::kFloat);
  const auto [a, b] = context_chunks(group.rank(), group.size());
  const std::vector<int64_t> mine{a, b};
  if (use_kernels(q, visible) && group.gathers_at_once()) {
    return GatheredContextAttention::apply(q, k, v, address_of(group)).transpose(1, 2);
  }
  if (use_kernels(q, visible)) {
    // The visited ranks' whole key blocks and the pairs of chunks that meet, then one function.
    std::vector<at::Tensor> kv;
    std::vector<Pair> pairs;
    group.for_each_kv(k, v, [&](int source, const at::Tensor& keys, const at::Tensor& values) {
      const auto [sa, sb] = context_chunks(source, group.size());
      const std::vector<int64_t> theirs{sa, sb};
      const auto index = static_cast<int64_t>(kv.size() / 2);
      kv.push_back(keys);
      kv.push_back(values);
      for (std::size_t i = 0; i < 2; ++i) {
        for (std::size_t j = 0; j < 2; ++j) {
          if (theirs[j] <= mine[i]) {
            pairs.push_back(
                {static_cast<int64_t>(i), index, static_cast<int64_t>(j), theirs[j] == mine[i]});
          }
        }
      }
    });
    return FusedContextAttention::apply(q, at::TensorList(kv), encode(pairs));
  }
  std::vector<std::vector<Block>> blocks(2);
  group.for_each_kv(k, v, [&](int source, const at::Tensor& keys, const at::Tensor& values) {
    const auto [sa, sb] = context_chunks(source, group.size());
    const std::vector<int64_t> theirs{sa, sb};
    for (std::size_t i = 0; i < 2; ++i) {
      const auto query = q.narrow(2, static_cast<int64_t>(i) * chunk, chunk);
      for (std::size_t j = 0; j < 2; ++j) {
        if (theirs[j] > mine[i]) {
          continue;  // a later chunk: hidden from every query of this one
        }
        at::Tensor keep;
        if (visible.defined()) {
          keep = visible.narrow(2, static_cast<int64_t>(i) * chunk, chunk)
                     .narrow(3, theirs[j] * chunk, chunk);
        }
        const auto offset = static_cast<int64_t>(j) * chunk;
        blocks[i].push_back(attend_block(query, keys.narrow(2, offset, chunk),
                                         values.narrow(2, offset, chunk), keep,
                                         theirs[j] == mine[i], acc));
      }
    }
  });
  return at::cat({merge(blocks[0]).out, merge(blocks[1]).out}, 2).to(q.scalar_type());
}

}  // namespace d9d::model
