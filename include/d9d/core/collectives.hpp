// d9d/core/collectives.hpp — collectives that allocate their outputs, over a d9d::ProcessGroup.
//
//   at::Tensor total = d9d::all_reduce(group, loss_sum);                    // new tensor
//   std::vector<at::Tensor> parts = d9d::all_gather_varying(group, tokens);  // shapes may differ
//   at::Tensor mine = d9d::all_to_all(group, rows, send_counts, recv_counts);
//
// Ranks (src, dst, peer) are ranks *within the group* (group.rank()), as in c10d. Inputs may live
// on any device: they are moved to group.device() for the backend and results come back on the
// input's device. On a group of one rank nothing is communicated. Every function is collective:
// all members call it, with matching arguments; a mismatch that can be seen locally (sizes, ranks)
// raises std::invalid_argument before anything is sent.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>

namespace d9d {

/// Reduction of all_reduce / reduce_scatter. `avg` is the sum divided by the group size.
enum class ReduceOp { sum, avg, max, min, product };

/// Element-wise reduction over the group; every rank gets the result.
at::Tensor all_reduce(const ProcessGroup& group, const at::Tensor& tensor,
                      ReduceOp op = ReduceOp::sum);

/// Every rank's tensor (same shape and dtype everywhere), in group order.
std::vector<at::Tensor> all_gather(const ProcessGroup& group, const at::Tensor& tensor);

/// all_gather, concatenated along `dim`.
at::Tensor all_gather_cat(const ProcessGroup& group, const at::Tensor& tensor, int64_t dim = 0);

/// Every rank's tensor when shapes differ between ranks (same dtype and number of dimensions):
/// the shapes are exchanged first.
std::vector<at::Tensor> all_gather_varying(const ProcessGroup& group, const at::Tensor& tensor);

/// Every rank's tensor (same shape everywhere) on `dst`; an empty vector on the other ranks.
std::vector<at::Tensor> gather(const ProcessGroup& group, const at::Tensor& tensor, int dst);

/// gather when shapes differ between ranks (same dtype and number of dimensions).
std::vector<at::Tensor> gather_varying(const ProcessGroup& group, const at::Tensor& tensor,
                                       int dst);

/// `tensor` of rank `src` on every rank. The other ranks pass a tensor of the same shape and
/// dtype (its values are ignored); see broadcast_varying when they do not know the shape.
at::Tensor broadcast(const ProcessGroup& group, const at::Tensor& tensor, int src);

/// broadcast where only `src` knows the shape and dtype (the others may pass an undefined tensor).
at::Tensor broadcast_varying(const ProcessGroup& group, const at::Tensor& tensor, int src);

/// Reduces `input` over the group and returns this rank's chunk along `dim`
/// (input.size(dim) must be divisible by the group size).
at::Tensor reduce_scatter(const ProcessGroup& group, const at::Tensor& input, int64_t dim = 0,
                          ReduceOp op = ReduceOp::sum);

/// Sends input rows [offset_j, offset_j + input_splits[j]) to group rank j and returns the rows
/// received, ordered by source rank (output_splits[j] of them from rank j). Splits along dim 0;
/// they may be uneven and zero.
at::Tensor all_to_all(const ProcessGroup& group, const at::Tensor& input,
                      const std::vector<int64_t>& input_splits,
                      const std::vector<int64_t>& output_splits);

/// The output_splits matching every rank's input_splits (an all_to_all of the counts).
std::vector<int64_t> exchange_splits(const ProcessGroup& group,
                                     const std::vector<int64_t>& input_splits);

/// One point-to-point operation of a batch.
struct P2POp {
  enum class Kind { send, recv };
  Kind kind = Kind::send;
  at::Tensor tensor;  ///< sent from / received into (recv fills it in place)
  int peer = 0;       ///< group rank of the other side
  int tag = 0;
};

/// Outstanding point-to-point operations; wait() blocks until all finished.
class P2PRequests {
 public:
  struct Impl;
  P2PRequests();
  explicit P2PRequests(std::shared_ptr<Impl> impl);
  void wait();

 private:
  std::shared_ptr<Impl> impl_;
};

/// Starts `ops` together (one NCCL group where the backend supports it). Receive tensors must be
/// on group.device(); send tensors are moved there.
P2PRequests batch_isend_irecv(const ProcessGroup& group, const std::vector<P2POp>& ops);

/// Byte strings of every rank, in group order (the transport of the object collectives).
std::vector<std::string> all_gather_bytes(const ProcessGroup& group, const std::string& bytes);
/// Byte strings of every rank on `dst`; empty on the others.
std::vector<std::string> gather_bytes(const ProcessGroup& group, const std::string& bytes, int dst);
/// The byte string of `src` on every rank.
std::string broadcast_bytes(const ProcessGroup& group, const std::string& bytes, int src);

/// Error agreement after a local part of a collective operation: every member passes what its
/// part raised (null: it succeeded). When any member failed, every member throws the same error:
/// std::invalid_argument when the first failed member's was one, else std::runtime_error, with
/// "<who>: rank <global rank> failed: <its what()>" (plus the other failed ranks), so no member
/// goes on to wait for a failed one. One all-gather of a few bytes per member.
///
///   std::exception_ptr error;
///   try { write_my_file(); } catch (...) { error = std::current_exception(); }
///   d9d::raise_if_any_failed(ctx.world(), error, "my_save");   // every rank, or none, throws
void raise_if_any_failed(const ProcessGroup& group, const std::exception_ptr& error,
                         const std::string& who);

}  // namespace d9d
