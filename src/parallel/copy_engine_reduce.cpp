// d9d/parallel/copy_engine_reduce.cpp — the copy-engine sum of GradientReducer's
// ReduceEngine::copy (detail/copy_engine_reduce.hpp).
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/parallel/detail/copy_engine_reduce.hpp>

#ifdef D9D_WITH_CUDA
#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.hpp>
#endif

namespace d9d::parallel::detail {

namespace {

[[noreturn]] void refuse(const std::string& why) {
  throw std::invalid_argument("d9d: data_parallel.reduce_engine \"copy\" " + why +
                              ". Fix: use reduce_engine \"backend\" (the group's all-reduce)");
}

}  // namespace

#ifdef D9D_WITH_CUDA

namespace symm = c10d::symmetric_memory;

struct CopyEngineReduce::Impl {
  // A barrier that waits this long for a peer traps the kernel (the job's watchdog names the rank
  // that stopped first).
  static constexpr std::size_t kBarrierTimeoutMs = std::size_t{30} * 60 * 1000;

  std::string name;
  at::Tensor buffer;
  c10::intrusive_ptr<symm::SymmetricMemory> handle;
  std::vector<char*> peers;                   // every rank's buffer, mapped into this process
  at::Tensor scratch;                         // the chunks pulled from the peers (uint8)
  std::optional<c10::cuda::CUDAStream> side;  // where the sums run, beside the caller's stream
  int rank = 0;
  int world = 1;

  char* address(int peer, int64_t byte) const {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-bounds-pointer-arithmetic): a peer's mapped buffer
    return peers[static_cast<std::size_t>(peer)] + byte;
  }
};

namespace {

// The name symmetric memory finds the group under: the same on every member (members create
// their reducers for a group in the same order), new for every reducer of this process.
std::string registry_name(const ProcessGroup& group) {
  static std::mutex mutex;
  static std::map<std::vector<int>, int> created;
  const std::lock_guard<std::mutex> lock(mutex);
  std::string name = "d9d/copy-engine-reduce/";
  for (const int r : group.ranks()) {
    name += std::to_string(r) + ",";
  }
  return name + "/" + std::to_string(created[group.ranks()]++);
}

}  // namespace

CopyEngineReduce::CopyEngineReduce(const ProcessGroup& group, int64_t bytes,
                                   int64_t max_range_bytes)
    : impl_(std::make_unique<Impl>()) {
  if (!group.device().is_cuda() || group.backend() == nullptr || group.store() == nullptr) {
    refuse("needs a CUDA group of two or more ranks (NCCL); this group is on " +
           group.device().str() + " with " + std::to_string(group.size()) + " rank(s)");
  }
  if (bytes < 1 || max_range_bytes < 1) {
    throw std::invalid_argument("d9d::parallel::detail::CopyEngineReduce: sizes must be >= 1");
  }
  auto& s = *impl_;
  s.rank = group.rank();
  s.world = group.size();
  s.name = registry_name(group);
  // Symmetric memory resolves the group by name: a c10d::ProcessGroup over the group's store
  // with its NCCL backend.
  auto store = c10::intrusive_ptr<c10d::Store>::reclaim_copy(group.store());
  auto wrapper = c10::make_intrusive<c10d::ProcessGroup>(store, s.rank, s.world);
  wrapper->setBackend(c10::kCUDA, c10d::ProcessGroup::BackendType::NCCL,
                      c10::intrusive_ptr<c10d::Backend>::reclaim_copy(group.backend()));
  wrapper->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  wrapper->setGroupName(s.name);
  c10d::register_process_group(s.name, wrapper);
  symm::set_group_info(s.name, s.rank, s.world, store);
  try {
    s.buffer =
        symm::empty_strided_p2p({bytes}, {1}, at::kByte, group.device(), s.name, std::nullopt);
    s.handle = symm::rendezvous(s.buffer, s.name);
  } catch (const std::exception& error) {
    refuse(
        "could not map the peers' buffers (the group's GPUs must share a node with peer "
        "access): " +
        std::string(error.what()));
  }
  if (!s.handle) {
    refuse("could not map the peers' buffers");
  }
  for (void* peer : s.handle->get_buffer_ptrs()) {
    s.peers.push_back(static_cast<char*>(peer));
  }
  // Rows aligned for every dtype's view.
  const int64_t row = ((max_range_bytes + s.world - 1) / s.world + 255) / 256 * 256;
  s.scratch = at::empty({s.world, row}, s.buffer.options());
  s.side = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, group.device().index());
}

CopyEngineReduce::~CopyEngineReduce() {
  if (impl_ && !impl_->name.empty()) {
    try {
      c10d::unregister_process_group(impl_->name);
    } catch (...) {  // NOLINT(bugprone-empty-catch): teardown is best effort
    }
  }
}

at::Tensor CopyEngineReduce::buffer() const { return impl_->buffer; }

void CopyEngineReduce::on_side(const std::function<void()>& work) {
  auto& side = *impl_->side;
  at::cuda::CUDAEvent ready;
  ready.record(at::cuda::getCurrentCUDAStream(side.device_index()));
  ready.block(side);
  const c10::cuda::CUDAStreamGuard guard(side);
  work();
}

void CopyEngineReduce::join() {
  auto& side = *impl_->side;
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(at::cuda::getCurrentCUDAStream(side.device_index()));
}

void CopyEngineReduce::sum(int64_t offset, int64_t numel, at::ScalarType dtype) {
  auto& s = *impl_;
  if (numel <= 0) {
    return;
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t chunk = (numel + s.world - 1) / s.world;  // elements per owner
  const auto range = [&](int owner) {                     // [byte, bytes) of owner's chunk
    const int64_t begin = std::min(numel, owner * chunk);
    const int64_t end = std::min(numel, begin + chunk);
    return std::pair{offset + begin * element, (end - begin) * element};
  };
  const auto stream = at::cuda::getCurrentCUDAStream();
  s.handle->barrier(0, Impl::kBarrierTimeoutMs);  // every rank's range is written
  const auto [mine, mine_bytes] = range(s.rank);
  if (mine_bytes > 0) {
    auto own = s.buffer.narrow(0, mine, mine_bytes).view(dtype);
    for (int step = 1; step < s.world; ++step) {
      const int peer = (s.rank + step) % s.world;
      auto slot = s.scratch[peer].narrow(0, 0, mine_bytes);
      C10_CUDA_CHECK(cudaMemcpyAsync(slot.data_ptr(), s.address(peer, mine),
                                     static_cast<std::size_t>(mine_bytes), cudaMemcpyDeviceToDevice,
                                     stream));
      own.add_(slot.view(dtype));
    }
  }
  s.handle->barrier(1, Impl::kBarrierTimeoutMs);  // every chunk holds its sum
  for (int step = 1; step < s.world; ++step) {
    const int peer = (s.rank + step) % s.world;
    const auto [theirs, bytes] = range(peer);
    if (bytes > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(s.address(s.rank, theirs), s.address(peer, theirs),
                                     static_cast<std::size_t>(bytes), cudaMemcpyDeviceToDevice,
                                     stream));
    }
  }
}

void CopyEngineReduce::end_of_step() { impl_->handle->barrier(2, Impl::kBarrierTimeoutMs); }

bool CopyEngineReduce::built() { return true; }

#else  // without CUDA (the constructor throws)

struct CopyEngineReduce::Impl {};

CopyEngineReduce::CopyEngineReduce(const ProcessGroup& group, int64_t /*bytes*/,
                                   int64_t /*max_range_bytes*/) {
  refuse("needs a CUDA build of d9d (this one has no CUDA); the group is on " +
         group.device().str());
}

CopyEngineReduce::~CopyEngineReduce() = default;

at::Tensor CopyEngineReduce::buffer() const { return {}; }
void CopyEngineReduce::on_side(const std::function<void()>& work) { work(); }
void CopyEngineReduce::join() {}
void CopyEngineReduce::sum(int64_t /*offset*/, int64_t /*numel*/, at::ScalarType /*dtype*/) {}
void CopyEngineReduce::end_of_step() {}

bool CopyEngineReduce::built() { return false; }

#endif

}  // namespace d9d::parallel::detail
