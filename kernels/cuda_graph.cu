// d9d/kernels/cuda_graph.cu — the CUDA implementation of d9d::kernels::MicrobatchGraph
// (at::cuda::CUDAGraph), installed when the library loads. Host code only: it lives with the
// kernels because it needs LibTorch's CUDA library, which CPU builds do not link.
//
// capture() follows the recipe of LibTorch's graphs: the current stream's work so far is made
// visible to a side stream (an event), the side stream captures `body` (allocations go to the
// graph's private pool, so the captured tensors stay valid for replays), and the current stream
// waits for the side stream afterwards. replay() launches the graph on the current stream.
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <d9d/kernels/cuda_graph.hpp>

namespace d9d::kernels {
namespace {

class CudaMicrobatchGraph final : public MicrobatchGraph {
 public:
  explicit CudaMicrobatchGraph(c10::Device device) : device_(device) {}

  void capture(const std::function<void()>& body, MicrobatchGraph* share_pool_with) override {
    const c10::cuda::CUDAGuard guard(device_);
    const auto current = c10::cuda::getCurrentCUDAStream(device_.index());
    const auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side);
    {
      const c10::cuda::CUDAStreamGuard on_side(side);
      // Graphs of this library are all CudaMicrobatchGraph.
      auto* other = static_cast<CudaMicrobatchGraph*>(share_pool_with);
      graph_.capture_begin(other != nullptr ? other->graph_.pool() : c10::MempoolId_t{0, 0});
      try {
        body();
      } catch (const std::exception& e) {
        end_after_failure();
        throw std::runtime_error(
            std::string("d9d: capturing a microbatch into a CUDA graph failed: ") + e.what() +
            ". The forward and backward must run without waiting for the host (no .item(), no "
            "shapes that depend on the data). Fix: make them so, or set \"cuda_graphs\": "
            "{\"enabled\": false}");
      }
      graph_.capture_end();
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(current);
  }

  void replay() override {
    const c10::cuda::CUDAGuard guard(device_);
    graph_.replay();
  }

 private:
  void end_after_failure() noexcept {
    try {
      graph_.capture_end();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the capture's own error is the one reported
    }
  }

  c10::Device device_;
  at::cuda::CUDAGraph graph_;
};

std::unique_ptr<MicrobatchGraph> make_graph(c10::Device device) {
  return std::make_unique<CudaMicrobatchGraph>(device);
}

// Installed when the library (or the kernels' shared library) loads.
const bool installed = [] {
  set_microbatch_graph_factory(&make_graph);
  return true;
}();

}  // namespace
}  // namespace d9d::kernels
