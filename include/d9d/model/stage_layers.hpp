// d9d/model/stage_layers.hpp — which decoder layers each pipeline stage holds.
//
//   auto ranges = d9d::model::distribute_layers(/*layers=*/28, /*stages=*/4,
//                                               {.embedding = 1.0, .head = 2.0});
//   ranges[0];  // {.begin = 0, .end = 6}: stage 0 also runs the embedding
//
// A pipeline-aware model provider builds only its stage's layers. Layers are split into contiguous
// ranges with the embedding (on the first stage) and the LM head (on the last) counted as virtual
// layers of the given weights, so the stages' loads are as equal as whole layers allow. In model/
// (not pipeline/): the stage models (Qwen3Stage, Qwen3MoeStage) take a LayerRange, and the pipeline
// sits above the model.
#pragma once

#include <stdexcept>
#include <vector>

namespace d9d::model {

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
