// d9d/model/stage_layers.hpp — which decoder layers each pipeline stage holds.
//
//   auto ranges = d9d::model::distribute_layers(/*layers=*/28, /*stages=*/4,
//                                               {.embedding = 1.0, .head = 2.0});
//   ranges[0];  // {.begin = 0, .end = 6}: stage 0 also runs the embedding
//
// A pipeline-aware model provider builds only its stage's layers. Layers are split into contiguous
// ranges with the embedding (on the first stage) and the LM head (on the last) counted as virtual
// layers of the given weights (pipeline_virtual_layers estimates them for Qwen3 models), so the
// stages' loads are as equal as whole layers allow. In model/ (not pipeline/): the stage models
// (Qwen3Stage, Qwen3MoeStage) take a LayerRange, and the pipeline sits above the model.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace d9d::model {

struct Qwen3Config;
struct Qwen3MoeConfig;

/// Decoder layers [begin, end) of one stage.
struct LayerRange {
  int begin = 0;
  int end = 0;

  [[nodiscard]] constexpr int size() const { return end - begin; }
  constexpr bool operator==(const LayerRange&) const = default;
};

/// Relative costs of what the first and last stages run besides their decoder layers, in layers.
struct VirtualLayers {
  double embedding = 0.0;  ///< on stage 0
  double head = 0.0;       ///< final norm + LM head (+ loss) on the last stage
};

/// The embedding and the LM head of a Qwen3 model as virtual layers, from forward FLOPs per
/// token: the head's 2 * hidden * vocab (with the cross-entropy, which FLOPs do not count: a
/// memory-bound softmax over the vocabulary) against the mean decoder layer's 2 per matmul
/// parameter plus causal attention at `sequence_length` tokens (2 * T * heads * head_dim; 0 leaves
/// it out). The embedding multiplies nothing, but its backward writes a vocab x hidden gradient:
/// half a layer. For Qwen3-0.6B at 2,048 tokens the head weighs 7.8 layers (measured on two H200s:
/// about 7), for an 8B shape about 3. Defined in src/model/qwen3_config.cpp.
[[nodiscard]] VirtualLayers pipeline_virtual_layers(const Qwen3Config& config,
                                                    int64_t sequence_length);
/// The same for a Qwen3-MoE model: a decoder layer counts its active parameters (top-k experts,
/// the shared expert, the router), averaged over the dense and sparse layers.
[[nodiscard]] VirtualLayers pipeline_virtual_layers(const Qwen3MoeConfig& config,
                                                    int64_t sequence_length);

namespace detail {
/// pipeline_virtual_layers' estimate for a decoder layer of `mean_layer_parameters` matmul
/// parameters (the part the dense and MoE overloads share).
[[nodiscard]] VirtualLayers qwen3_virtual_layers(const Qwen3Config& config,
                                                 double mean_layer_parameters,
                                                 int64_t sequence_length);
}  // namespace detail

/// Contiguous ranges of `layers` decoder layers over `stages` stages, balancing layers plus the
/// virtual layers; a stage may get no decoder layer when there are fewer layers than stages.
constexpr std::vector<LayerRange> distribute_layers(int layers, int stages,
                                                    VirtualLayers extra = {}) {
  if (layers < 0 || stages < 1 || extra.embedding < 0 || extra.head < 0) {
    throw std::invalid_argument(
        "d9d::model::distribute_layers: needs layers >= 0, stages >= 1 and non-negative "
        "virtual layers");
  }
  const double total = layers + extra.embedding + extra.head;
  std::vector<LayerRange> out;
  int begin = 0;
  for (int s = 0; s < stages; ++s) {
    int end = layers;
    if (s + 1 < stages) {
      // The decoder layers that end at the stage's share of the total load, rounded half up.
      const double boundary = (s + 1) * total / stages - extra.embedding;
      end = boundary <= 0 ? 0 : static_cast<int>(boundary + 0.5);
      end = end < begin ? begin : (end > layers ? layers : end);
    }
    out.push_back({.begin = begin, .end = end});
    begin = end;
  }
  return out;
}

}  // namespace d9d::model
