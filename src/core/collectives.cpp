// d9d/core/collectives.cpp — allocating collectives over c10d backends.
#include <algorithm>
#include <numeric>
#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/core/collectives.hpp>

namespace d9d {
namespace {

constexpr int64_t kMaxDims = 16;  // shape exchange buffer: [ndim, numel, d0 .. d15]

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return c10d::ReduceOp::SUM;
    case ReduceOp::max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::product:
      return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

void check_rank(const ProcessGroup& group, int rank, const char* what) {
  if (rank < 0 || rank >= group.size()) {
    throw std::invalid_argument(std::string("d9d collectives: ") + what + " rank " +
                                std::to_string(rank) + " is outside the group of " +
                                std::to_string(group.size()));
  }
}

// A contiguous copy on the group's device (the backend works in place on it).
at::Tensor staged(const ProcessGroup& group, const at::Tensor& tensor) {
  if (!tensor.defined()) {
    throw std::invalid_argument("d9d collectives: undefined tensor");
  }
  return tensor.to(group.device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
}

// `tensor` itself when it is contiguous on the group's device (for collectives that only read
// their input), else a contiguous copy there.
at::Tensor readable(const ProcessGroup& group, const at::Tensor& tensor) {
  if (!tensor.defined()) {
    throw std::invalid_argument("d9d collectives: undefined tensor");
  }
  if (tensor.device() == group.device() && tensor.is_contiguous()) {
    return tensor;
  }
  return tensor.to(group.device()).contiguous();
}

at::Tensor finish_avg(at::Tensor result, const ProcessGroup& group, ReduceOp op) {
  if (op == ReduceOp::avg) {
    if (at::isIntegralType(result.scalar_type(), /*includeBool=*/true)) {
      result.div_(group.size(), "floor");
    } else {
      result.div_(group.size());
    }
  }
  return result;
}

// [ndim, numel, d0 .. d15] as int64 on the group's device.
at::Tensor shape_record(const ProcessGroup& group, const at::Tensor& tensor) {
  if (tensor.dim() > kMaxDims) {
    throw std::invalid_argument(
        "d9d collectives: tensors of more than 16 dimensions are not supported");
  }
  std::vector<int64_t> record(2 + kMaxDims, 0);
  record[0] = tensor.dim();
  record[1] = tensor.numel();
  for (int64_t i = 0; i < tensor.dim(); ++i) {
    record[static_cast<std::size_t>(2 + i)] = tensor.size(i);
  }
  return at::tensor(record, at::kLong).to(group.device());
}

std::vector<int64_t> shape_of(const at::Tensor& record) {
  const auto cpu = record.cpu();
  const auto* data = cpu.const_data_ptr<int64_t>();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-bounds-pointer-arithmetic)
  return {data + 2, data + 2 + data[0]};
}

// Pads the flattened tensor to `length` elements.
at::Tensor padded_flat(const at::Tensor& tensor, int64_t length) {
  auto flat = tensor.reshape({-1});
  if (flat.numel() == length) {
    return flat.contiguous();
  }
  auto out = at::zeros({length}, flat.options());
  out.narrow(0, 0, flat.numel()).copy_(flat);
  return out;
}

// Checks that every rank sent the same number of dimensions (shapes of a varying collective).
void check_same_ndim(const std::vector<at::Tensor>& records, const char* what) {
  const auto ndim = records.front().cpu().const_data_ptr<int64_t>()[0];
  for (std::size_t r = 1; r < records.size(); ++r) {
    if (records[r].cpu().const_data_ptr<int64_t>()[0] != ndim) {
      throw std::invalid_argument(
          std::string("d9d collectives: ") + what +
          " needs the same number of dimensions on every rank (rank 0 has " + std::to_string(ndim) +
          ", rank " + std::to_string(r) + " has " +
          std::to_string(records[r].cpu().const_data_ptr<int64_t>()[0]) + ")");
    }
  }
}

}  // namespace

at::Tensor all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  if (group.size() <= 1) {
    return tensor.clone();
  }
  auto buffer = staged(group, tensor);
  std::vector<at::Tensor> tensors = {buffer};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  group.backend()->allreduce(tensors, options)->wait();
  return finish_avg(buffer, group, op).to(tensor.device());
}

std::vector<at::Tensor> all_gather(const ProcessGroup& group, const at::Tensor& tensor) {
  if (group.size() <= 1) {
    return {tensor.clone()};
  }
  auto input = staged(group, tensor);
  std::vector<at::Tensor> inputs = {input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.size(); ++r) {
    outputs[0].push_back(at::empty_like(input));
  }
  group.backend()->allgather(outputs, inputs)->wait();
  for (auto& out : outputs[0]) {
    out = out.to(tensor.device());
  }
  return outputs[0];
}

at::Tensor all_gather_cat(const ProcessGroup& group, const at::Tensor& tensor, int64_t dim) {
  if (group.size() <= 1) {
    return tensor.clone();
  }
  if (tensor.dim() == 0) {
    throw std::invalid_argument("d9d::all_gather_cat: tensor must have at least one dimension");
  }
  dim = at::maybe_wrap_dim(dim, tensor.dim());
  // One collective into [size, ...] (the ranks' tensors one after another), then the rank
  // dimension moved in front of `dim` and merged with it: a view for dim 0, else one copy
  // (instead of a buffer per rank, the backend's copies into them and a concatenation).
  const auto input = readable(group, tensor);
  auto sizes = input.sizes().vec();
  // The backends take the output as the inputs concatenated along dim 0.
  auto flat = sizes;
  flat[0] *= group.size();
  auto output = at::empty(flat, input.options());
  auto source = input;
  group.backend()->_allgather_base(output, source)->wait();
  std::vector<int64_t> ranked = {group.size()};
  ranked.insert(ranked.end(), sizes.begin(), sizes.end());
  sizes[static_cast<std::size_t>(dim)] *= group.size();
  return output.view(ranked).movedim(0, dim).reshape(sizes).to(tensor.device());
}

std::vector<at::Tensor> all_gather_varying(const ProcessGroup& group, const at::Tensor& tensor) {
  if (group.size() <= 1) {
    return {tensor.clone()};
  }
  const auto records = all_gather(group, shape_record(group, tensor));
  check_same_ndim(records, "all_gather_varying");
  int64_t longest = 0;
  for (const auto& record : records) {
    longest = std::max(longest, record.cpu().const_data_ptr<int64_t>()[1]);
  }
  const auto flat = all_gather(group, padded_flat(tensor, longest));
  std::vector<at::Tensor> out;
  out.reserve(flat.size());
  for (std::size_t r = 0; r < flat.size(); ++r) {
    const auto shape = shape_of(records[r]);
    const auto numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    out.push_back(flat[r].narrow(0, 0, numel).reshape(shape));
  }
  return out;
}

std::vector<at::Tensor> gather(const ProcessGroup& group, const at::Tensor& tensor, int dst) {
  check_rank(group, dst, "gather destination");
  if (group.size() <= 1) {
    return {tensor.clone()};
  }
  auto input = staged(group, tensor);
  std::vector<at::Tensor> inputs = {input};
  std::vector<std::vector<at::Tensor>> outputs;
  if (group.rank() == dst) {
    outputs.resize(1);
    for (int r = 0; r < group.size(); ++r) {
      outputs[0].push_back(at::empty_like(input));
    }
  }
  c10d::GatherOptions options;
  options.rootRank = dst;
  group.backend()->gather(outputs, inputs, options)->wait();
  if (group.rank() != dst) {
    return {};
  }
  for (auto& out : outputs[0]) {
    out = out.to(tensor.device());
  }
  return outputs[0];
}

std::vector<at::Tensor> gather_varying(const ProcessGroup& group, const at::Tensor& tensor,
                                       int dst) {
  check_rank(group, dst, "gather destination");
  if (group.size() <= 1) {
    return {tensor.clone()};
  }
  // Every rank needs the longest length to pad to, so the shapes are all-gathered.
  const auto records = all_gather(group, shape_record(group, tensor));
  check_same_ndim(records, "gather_varying");
  int64_t longest = 0;
  for (const auto& record : records) {
    longest = std::max(longest, record.cpu().const_data_ptr<int64_t>()[1]);
  }
  const auto flat = gather(group, padded_flat(tensor, longest), dst);
  std::vector<at::Tensor> out;
  for (std::size_t r = 0; r < flat.size(); ++r) {
    const auto shape = shape_of(records[r]);
    const auto numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    out.push_back(flat[r].narrow(0, 0, numel).reshape(shape));
  }
  return out;
}

at::Tensor broadcast(const ProcessGroup& group, const at::Tensor& tensor, int src) {
  check_rank(group, src, "broadcast source");
  if (group.size() <= 1) {
    return tensor.clone();
  }
  auto buffer = staged(group, tensor);
  std::vector<at::Tensor> tensors = {buffer};
  c10d::BroadcastOptions options;
  options.rootRank = src;
  group.backend()->broadcast(tensors, options)->wait();
  return buffer.to(tensor.device());
}

at::Tensor broadcast_varying(const ProcessGroup& group, const at::Tensor& tensor, int src) {
  check_rank(group, src, "broadcast source");
  if (group.size() <= 1) {
    return tensor.clone();
  }
  // [ndim, numel, dtype, d0 .. d15] from the source.
  at::Tensor record;
  if (group.rank() == src) {
    record = shape_record(group, tensor);
    record = at::cat(
        {record,
         at::tensor({static_cast<int64_t>(tensor.scalar_type())}, at::kLong).to(group.device())});
  } else {
    record =
        at::zeros({2 + kMaxDims + 1}, at::TensorOptions().dtype(at::kLong).device(group.device()));
  }
  record = broadcast(group, record, src).cpu();
  const auto shape = shape_of(record);
  const auto dtype = static_cast<at::ScalarType>(record.const_data_ptr<int64_t>()[2 + kMaxDims]);
  const at::Tensor input =
      group.rank() == src
          ? tensor
          : at::empty(shape, at::TensorOptions().dtype(dtype).device(
                                 tensor.defined() ? tensor.device() : group.device()));
  return broadcast(group, input, src);
}

at::Tensor reduce_scatter(const ProcessGroup& group, const at::Tensor& input, int64_t dim,
                          ReduceOp op) {
  const int64_t size = group.size();
  if (input.dim() == 0) {
    throw std::invalid_argument("d9d::reduce_scatter: input must have at least one dimension");
  }
  dim = at::maybe_wrap_dim(dim, input.dim());
  if (input.size(dim) % size != 0) {
    throw std::invalid_argument("d9d::reduce_scatter: input.size(" + std::to_string(dim) +
                                ") = " + std::to_string(input.size(dim)) +
                                " is not divisible by the group size " + std::to_string(size));
  }
  if (size <= 1) {
    return input.clone();
  }
  // The chunks along `dim` laid out one after another ([size, ...]: a view for dim 0, else one
  // copy) and reduced by one collective into this rank's chunk (instead of a copy per chunk and
  // the backend's copy of them into one buffer). The input is only read.
  const auto readable_input = readable(group, input);
  auto sizes = readable_input.sizes().vec();
  const auto d = static_cast<std::size_t>(dim);
  sizes[d] /= size;
  auto split = sizes;
  split.insert(split.begin() + dim, size);
  // As the backends take it: the chunks concatenated along dim 0.
  auto flat = sizes;
  flat[0] *= size;
  auto chunks = readable_input.view(split).movedim(dim, 0).contiguous().view(flat);
  auto output = at::empty(sizes, readable_input.options());
  c10d::ReduceScatterOptions options;
  options.reduceOp = to_c10d(op);
  group.backend()->_reduce_scatter_base(output, chunks, options)->wait();
  return finish_avg(output, group, op).to(input.device());
}

at::Tensor all_to_all(const ProcessGroup& group, const at::Tensor& input,
                      const std::vector<int64_t>& input_splits,
                      const std::vector<int64_t>& output_splits) {
  const auto size = static_cast<std::size_t>(group.size());
  if (input_splits.size() != size || output_splits.size() != size) {
    throw std::invalid_argument("d9d::all_to_all: need one input and one output split per rank (" +
                                std::to_string(size) + "), got " +
                                std::to_string(input_splits.size()) + " and " +
                                std::to_string(output_splits.size()));
  }
  const auto sent = std::accumulate(input_splits.begin(), input_splits.end(), int64_t{0});
  const auto received = std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0});
  if (input.dim() == 0 || sent != input.size(0)) {
    throw std::invalid_argument("d9d::all_to_all: input_splits add up to " + std::to_string(sent) +
                                " rows but the input has " +
                                std::to_string(input.dim() == 0 ? 0 : input.size(0)));
  }
  if (size <= 1) {
    return input.clone();
  }
  auto staged_input = staged(group, input);
  auto sizes = staged_input.sizes().vec();
  sizes[0] = received;
  auto output = at::empty(sizes, staged_input.options());
  auto in_splits = input_splits;
  auto out_splits = output_splits;
  group.backend()->alltoall_base(output, staged_input, out_splits, in_splits)->wait();
  return output.to(input.device());
}

std::vector<int64_t> exchange_splits(const ProcessGroup& group,
                                     const std::vector<int64_t>& input_splits) {
  const auto size = static_cast<std::size_t>(group.size());
  if (input_splits.size() != size) {
    throw std::invalid_argument("d9d::exchange_splits: need one split per rank (" +
                                std::to_string(size) + "), got " +
                                std::to_string(input_splits.size()));
  }
  const auto counts = at::tensor(input_splits, at::kLong);
  const std::vector<int64_t> ones(size, 1);
  const auto received = all_to_all(group, counts, ones, ones).cpu();
  const auto* data = received.const_data_ptr<int64_t>();
  return {data, data + size};  // NOLINT(cppcoreguidelines-pro-bounds-pointer-arithmetic)
}

// ------------------------------------------------------------------------------------------------
// Point to point

struct P2PRequests::Impl {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // The send tensors copied onto the group's device: alive until the operations are done. Under
  // NCCL's coalescing the sends are launched together at the end, after each op's temporary would
  // otherwise have gone back to the allocator (and been reused by the next op's copy).
  std::vector<at::Tensor> sent;
};

P2PRequests::P2PRequests() : impl_(std::make_shared<Impl>()) {}
P2PRequests::P2PRequests(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

void P2PRequests::wait() {
  for (auto& work : impl_->works) {
    work->wait();
  }
  impl_->works.clear();
  impl_->sent.clear();
}

P2PRequests batch_isend_irecv(const ProcessGroup& group, const std::vector<P2POp>& ops) {
  auto impl = std::make_shared<P2PRequests::Impl>();
  if (ops.empty()) {
    return P2PRequests(impl);
  }
  for (const auto& op : ops) {
    check_rank(group, op.peer, "point-to-point peer");
    if (op.peer == group.rank()) {
      throw std::invalid_argument(
          "d9d::batch_isend_irecv: a rank cannot send to or receive from "
          "itself (peer " +
          std::to_string(op.peer) + ")");
    }
    if (op.kind == P2POp::Kind::recv &&
        (op.tensor.device() != group.device() || !op.tensor.is_contiguous())) {
      throw std::invalid_argument(
          "d9d::batch_isend_irecv: receive tensors must be contiguous and on " +
          group.device().str());
    }
  }
  auto* backend = group.backend();
  const bool coalesce = backend->supportsCoalescing();
  if (coalesce) {
    backend->startCoalescing();
  }
  for (const auto& op : ops) {
    std::vector<at::Tensor> tensors = {
        op.kind == P2POp::Kind::send ? op.tensor.to(group.device()).contiguous() : op.tensor};
    if (op.kind == P2POp::Kind::send) {
      impl->sent.push_back(tensors.front());
    }
    auto work = op.kind == P2POp::Kind::send ? backend->send(tensors, op.peer, op.tag)
                                             : backend->recv(tensors, op.peer, op.tag);
    if (!coalesce && work) {
      impl->works.push_back(work);
    }
  }
  if (coalesce) {
    if (auto work = backend->endCoalescing()) {
      impl->works.push_back(work);
    }
  }
  return P2PRequests(impl);
}

// ------------------------------------------------------------------------------------------------
// Bytes (object collectives)

namespace {

at::Tensor bytes_tensor(const std::string& bytes) {
  auto out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::copy(bytes.begin(), bytes.end(), out.mutable_data_ptr<uint8_t>());
  return out;
}

std::string tensor_bytes(const at::Tensor& tensor) {
  const auto cpu = tensor.cpu().contiguous();
  const auto* data = cpu.const_data_ptr<uint8_t>();
  return {data, data + cpu.numel()};  // NOLINT(cppcoreguidelines-pro-bounds-pointer-arithmetic)
}

}  // namespace

std::vector<std::string> all_gather_bytes(const ProcessGroup& group, const std::string& bytes) {
  std::vector<std::string> out;
  for (const auto& part : all_gather_varying(group, bytes_tensor(bytes))) {
    out.push_back(tensor_bytes(part));
  }
  return out;
}

std::vector<std::string> gather_bytes(const ProcessGroup& group, const std::string& bytes,
                                      int dst) {
  std::vector<std::string> out;
  for (const auto& part : gather_varying(group, bytes_tensor(bytes), dst)) {
    out.push_back(tensor_bytes(part));
  }
  return out;
}

std::string broadcast_bytes(const ProcessGroup& group, const std::string& bytes, int src) {
  return tensor_bytes(broadcast_varying(group, bytes_tensor(bytes), src));
}

void raise_if_any_failed(const ProcessGroup& group, const std::exception_ptr& error,
                         const std::string& who) {
  // "": fine; "i<what>": std::invalid_argument; "r<what>": anything else.
  std::string mine;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::invalid_argument& e) {
      mine = std::string("i") + e.what();
    } catch (const std::exception& e) {
      mine = std::string("r") + e.what();
    } catch (...) {
      mine = "ra non-standard exception";
    }
  }
  const auto all =
      group.size() > 1 ? all_gather_bytes(group, mine) : std::vector<std::string>{mine};
  std::string message;
  bool invalid = false;
  std::vector<int> others;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].empty()) {
      continue;
    }
    const int rank = group.size() > 1 ? group.ranks()[i] : (group.valid() ? group.ranks()[0] : 0);
    if (message.empty()) {
      invalid = all[i][0] == 'i';
      std::string what = all[i].substr(1);
      if (what.rfind(who + ": ", 0) == 0) {
        what = what.substr(who.size() + 2);  // said once is enough
      }
      message = who + ": rank " + std::to_string(rank) + " failed: " + what;
    } else {
      others.push_back(rank);
    }
  }
  if (message.empty()) {
    return;
  }
  if (!others.empty()) {
    message += " (rank";
    message += others.size() > 1 ? "s" : "";
    for (std::size_t i = 0; i < others.size(); ++i) {
      message += (i == 0 ? " " : ", ") + std::to_string(others[i]);
    }
    message += " failed too)";
  }
  if (invalid) {
    throw std::invalid_argument(message);
  }
  throw std::runtime_error(message);
}

}  // namespace d9d
