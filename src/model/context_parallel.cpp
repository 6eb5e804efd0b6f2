// d9d/model/context_parallel.cpp — the load-balanced chunks of context parallelism and the
// attention of a rank's chunks over every rank's keys, block by block with an online-softmax merge.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/model/context_parallel.hpp>

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

// The blocks of one query chunk merged: softmax over the union of their keys.
at::Tensor merge(const std::vector<Block>& blocks) {
  std::vector<at::Tensor> outs;
  std::vector<at::Tensor> lses;
  for (const auto& block : blocks) {
    outs.push_back(block.out);
    lses.push_back(block.lse);
  }
  const auto lse = at::stack(lses);                                 // [n, B, heads, L]
  const auto weights = at::exp(lse - at::logsumexp(lse, 0, true));  // each block's share
  return (at::stack(outs) * weights.unsqueeze(-1)).sum(0);
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
  return at::cat({merge(blocks[0]), merge(blocks[1])}, 2).to(q.scalar_type());
}

}  // namespace d9d::model
