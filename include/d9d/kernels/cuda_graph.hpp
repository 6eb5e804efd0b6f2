// d9d/kernels/cuda_graph.hpp — a captured microbatch (CUDA graph) behind an interface that CPU
// builds compile.
//
//   auto graph = d9d::kernels::make_microbatch_graph(device);  // throws on CPU or a CPU build
//   graph->capture([&] { loss = step(batch); });                // records, runs nothing
//   graph->replay();                                            // runs the recorded work
//
// TrainStepCore captures one microbatch's forward and backward into a MicrobatchGraph and replays
// it for the step's microbatches (docs/train.md, "CUDA graphs"). The CUDA implementation lives in
// kernels/cuda_graph.cu (built with the CUDA kernels) and registers its factory when the library
// loads; a build without it has none, and make_microbatch_graph says so (the registry:
// src/kernels/cuda_graph.cpp).
#pragma once

#include <functional>
#include <memory>

#include <c10/core/Device.h>

namespace d9d::kernels {

/// One captured piece of GPU work, replayed on the current stream.
class MicrobatchGraph {
 public:
  MicrobatchGraph() = default;
  virtual ~MicrobatchGraph() = default;
  MicrobatchGraph(const MicrobatchGraph&) = delete;
  MicrobatchGraph& operator=(const MicrobatchGraph&) = delete;
  MicrobatchGraph(MicrobatchGraph&&) = delete;
  MicrobatchGraph& operator=(MicrobatchGraph&&) = delete;

  /// Records what `body` launches on the device (on a side stream, in a private memory pool, or in
  /// `share_pool_with`'s when given: graphs replayed one after the other may share one); nothing
  /// runs until replay(). An exception from `body` or from the capture ends the capture and
  /// propagates.
  virtual void capture(const std::function<void()>& body,
                       MicrobatchGraph* share_pool_with = nullptr) = 0;
  /// Runs the recorded work once, on the device's current stream.
  virtual void replay() = 0;
};

using MicrobatchGraphFactory = std::unique_ptr<MicrobatchGraph> (*)(c10::Device device);

/// Installs the factory (the CUDA kernels library does, when it loads).
void set_microbatch_graph_factory(MicrobatchGraphFactory factory);

/// A graph for `device`: std::invalid_argument when the device is not CUDA or when this build of
/// d9d has no CUDA kernels library.
std::unique_ptr<MicrobatchGraph> make_microbatch_graph(c10::Device device);

}  // namespace d9d::kernels
