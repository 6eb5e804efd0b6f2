// d9d/kernels/moe_permute.hpp — the MoE layer's permute and un-permute as LibTorch custom ops: the
// routing indices computed on the device (a stable counting sort of the (token, slot) pairs by
// expert, the expert capacity applied), one gather of the rows into expert order, and one weighted
// sum back per token.
//
//   auto r = d9d::kernels::moe_route_indices(experts.reshape(-1), E, k, capacity);  // no host sync
//   auto rows = d9d::kernels::moe_permute(x, r.token.narrow(0, 0, kept), r.position);  // [kept, H]
//   auto y = d9d::kernels::moe_unpermute(expert_fn(rows), weights, r.position);        // [N, H]
//
// (`kept` is the sum of r.kept_counts, read on the host by the caller, who needs the counts there
// for the grouped GEMM anyway: d9d::model::MoeLayer reads them once, dropless or not.)
//
// Definitions. N tokens each choose k experts: pair p = t * k + j is token t's j-th choice,
// chosen[p] in [0, E). counts[e] = #{p : chosen[p] = e}; a pair's place is #{q < p : chosen[q] =
// chosen[p]} (its index in its expert's run, token order); it is kept when capacity < 0 or place <
// capacity, so kept_counts[e] = min(counts[e], capacity). `order` lists the kept pairs by expert
// (stable: increasing p within an expert), then the dropped pairs likewise: its first sum(kept)
// entries are exactly at::sort(chosen, stable) masked by d9d::model::within_capacity. token[i] =
// order[i] / k; position[t, j] = i where order[i] = t * k + j if that pair is kept, else -1.
//   moe_permute:   rows[i] = x[token[i]]                         (at::index_select(x, 0, token))
//     backward:    dx[t] = sum of drows[position[t, j]] over t's kept pairs    (index_add)
//   moe_unpermute: y[t] = sum over t's kept pairs of outputs[position[t, j]] * weights[t, j]
//     backward:    doutputs[position[t, j]] = dy[t] * weights[t, j];
//                  dweights[t, j] = dot(dy[t], outputs[position[t, j]]) (0 for a dropped pair)
// The sums over a token's pairs run in increasing position (expert order, as transformers sums),
// in float (double for double), rounded once; products are rounded to the op-math type before the
// addition (the CUDA kernels multiply with __fmul_rn / __dmul_rn; the CPU loops rely on the
// compiler fusing no multiply-add, as x86-64's baseline instruction set has none). In float32 and
// float64 that is bit for bit what the ATen composition d9d::model::MoeLayer used before,
// zeros.index_add(0, token, outputs * weights[order]) and its autograd (the weight gradient's dot
// product excepted: ATen's sum orders its additions differently); in bfloat16 and float16 the
// composition rounds every product and every partial sum to 8 or 11 bits and these ops do not.
//
// Determinism: every result is a function of the inputs alone, on CPU and CUDA, whatever the launch
// shape or thread timing; no floating-point atomics anywhere (the row sums above are done by one
// thread block per token over an inverse index, `position`, not by atomicAdd). The CUDA row sums
// take the CPU reference's order and roundings, so they equal it bit for bit in every dtype (what
// tests/kernels/moe_permute_cuda_test.cpp checks on a GPU); the weight gradient's dot product is a
// fixed tree sum on CUDA and a sequential one on the CPU.
//
// Cost on CUDA (P = N * k pairs, M kept, H hidden, E experts; all on the current stream, no host
// synchronisation): moe_route_indices three small kernels (per-chunk histograms with shared-memory
// atomics, one block scanning the [P / 1024, E] histogram, serially over the chunks per expert, a
// stable placement with warp match-any ranks): reads chosen twice, writes order, token, position
// (P int64 each). moe_permute one gather (reads and writes M rows); its backward one kernel (reads
// M rows, writes N). moe_unpermute one kernel (reads M rows, writes N); its backward one kernel
// (reads M rows of outputs and the token's dy once per kept pair, writes M rows and P weights).
// Rows move as 16-byte vectors when H * element size is a multiple of 16. Not measured yet.
// On the CPU: plain loops over rows (at::parallel_for), the counting sort serial.
//
// Schemas (namespace `d9d`; CPU in src/kernels/moe_permute.cpp, CUDA in kernels/moe_permute.cu):
//   moe_route_indices(Tensor chosen, int num_experts, int top_k, int capacity)
//       -> (Tensor order, Tensor token, Tensor position, Tensor counts, Tensor kept_counts)
//   moe_permute(Tensor x, Tensor token, Tensor position) -> Tensor                 (autograd)
//   moe_permute_forward(Tensor x, Tensor token) -> Tensor                          (no autograd)
//   moe_permute_backward(Tensor grad, Tensor position) -> Tensor                   (dx)
//   moe_unpermute(Tensor outputs, Tensor weights, Tensor position) -> Tensor       (autograd)
//   moe_unpermute_forward(Tensor outputs, Tensor weights, Tensor position) -> Tensor
//   moe_unpermute_backward(Tensor grad, Tensor outputs, Tensor weights, Tensor position)
//       -> (Tensor, Tensor)                                              (doutputs, dweights)
#pragma once

#include <cstdint>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// The routing indices of N tokens' top-k choices (see the file comment), all on chosen's device.
struct MoeRouting {
  at::Tensor order;        ///< [N * k] int64: kept pairs by expert (stable), then the dropped ones
  at::Tensor token;        ///< [N * k] int64: order / k
  at::Tensor position;     ///< [N, k] int64: each pair's index in order, -1 when dropped
  at::Tensor counts;       ///< [E] int64: routings per expert, before dropping
  at::Tensor kept_counts;  ///< [E] int64: after dropping, min(counts, capacity)
};

/// Routes `chosen` (int64, N * k expert ids in [0, num_experts), token-major, any shape) with each
/// expert keeping at most `capacity` pairs (< 0: all). No autograd, no host synchronisation (on
/// CUDA, ids out of range trip a device assertion). CUDA takes up to 4096 experts.
[[nodiscard]] MoeRouting moe_route_indices(const at::Tensor& chosen, int64_t num_experts,
                                           int64_t top_k, int64_t capacity);

/// x [N, H] gathered into rows [M, H]: rows[i] = x[token[i]], with autograd (x's gradient summed
/// per token over `position` [N, k], deterministically). token and position come from one
/// moe_route_indices (token narrowed to its first M entries, M <= N * k).
[[nodiscard]] at::Tensor moe_permute(const at::Tensor& x, const at::Tensor& token,
                                     const at::Tensor& position);

/// The gather alone: x[token]. No autograd.
[[nodiscard]] at::Tensor moe_permute_forward(const at::Tensor& x, const at::Tensor& token);

/// moe_permute's backward alone: dx [N, H] (N = position.size(0)) from drows [M, H]. No autograd.
[[nodiscard]] at::Tensor moe_permute_backward(const at::Tensor& grad, const at::Tensor& position);

/// outputs [M, H] (in expert order) weighted by weights [N, k] and summed per token: [N, H], with
/// autograd in outputs and weights. outputs and weights share a floating dtype and device.
[[nodiscard]] at::Tensor moe_unpermute(const at::Tensor& outputs, const at::Tensor& weights,
                                       const at::Tensor& position);

/// The forward kernel alone. No autograd.
[[nodiscard]] at::Tensor moe_unpermute_forward(const at::Tensor& outputs, const at::Tensor& weights,
                                               const at::Tensor& position);

/// The backward kernel alone: (doutputs [M, H], dweights [N, k]). No autograd.
[[nodiscard]] std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward(const at::Tensor& grad,
                                                                        const at::Tensor& outputs,
                                                                        const at::Tensor& weights,
                                                                        const at::Tensor& position);

namespace detail {

/// Checks moe_route_indices' arguments (chosen int64 with N * k elements, N * k < 2^31, E >= 1,
/// k >= 1); returns N * k.
int64_t check_moe_route(const at::Tensor& chosen, int64_t num_experts, int64_t top_k);

/// Checks a gather's or scatter's index tensors against rows of `rows_like` (2-D, same device):
/// `token` (when defined) 1-D int64 of at most position.numel() entries, `position` 2-D int64 with
/// `tokens` rows (when tokens >= 0).
void check_moe_indices(const char* op, const at::Tensor& rows_like, const at::Tensor& token,
                       const at::Tensor& position, int64_t tokens);

/// Checks moe_unpermute's arguments: outputs [M, H] floating, weights [N, k] of its dtype and
/// device, position of weights' shape, and grad [N, H] when defined.
void check_moe_unpermute(const at::Tensor& outputs, const at::Tensor& weights,
                         const at::Tensor& position, const at::Tensor& grad);

}  // namespace detail
}  // namespace d9d::kernels
