// d9d/kernels/cuda_graph.cpp — the registry of the CUDA-graph factory (the CUDA kernels
// library installs it; CPU builds have none).
#include <atomic>
#include <stdexcept>

#include <d9d/kernels/cuda_graph.hpp>

namespace d9d::kernels {
namespace {

std::atomic<MicrobatchGraphFactory>& factory() {
  static std::atomic<MicrobatchGraphFactory> instance{nullptr};
  return instance;
}

}  // namespace

void set_microbatch_graph_factory(MicrobatchGraphFactory make) { factory().store(make); }

std::unique_ptr<MicrobatchGraph> make_microbatch_graph(c10::Device device) {
  if (!device.is_cuda()) {
    throw std::invalid_argument("d9d: CUDA graphs capture work on a CUDA device; this run is on " +
                                device.str() + ". Fix: set \"cuda_graphs\": {\"enabled\": false}");
  }
  const auto make = factory().load();
  if (make == nullptr) {
    throw std::invalid_argument(
        "d9d: CUDA graphs need the CUDA kernels library, which this build of d9d lacks. Fix: build "
        "with CUDA (CMake -DD9D_WITH_CUDA=ON), or set \"cuda_graphs\": {\"enabled\": false}");
  }
  return make(device);
}

}  // namespace d9d::kernels
