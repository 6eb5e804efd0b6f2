// d9d/model/block.hpp — d9d::model::Block: a part of a model that strategies treat as one unit
// (a decoder layer), with hooks around its forward.
//
//   class MyLayerImpl : public torch::nn::Module, public d9d::model::Block {
//     at::Tensor forward(const at::Tensor& x) {
//       return run_block(x, [this](const at::Tensor& in) { return in + mlp(norm(in)); });
//     }
//   };
//
// LibTorch modules have no forward hooks, so the modules that want them say where their forward
// is: run_block(x, body) runs the pre-forward hooks, then body(x) — directly, or through the
// block's wrapper (activation recompute) — then the post-forward hooks over the result. Fully
// sharded data parallelism gathers a block's parameters in a pre-hook and frees them in a post-hook
// (d9d/parallel/fully_shard.hpp); recompute runs the body again during backward, so a body must
// capture what it needs by value (tensors, `this`), never references to the caller's locals. A
// model without blocks still trains under every strategy: its parameters then form one unit.
//
// A block may also name parts of its body (declare_part, run_part): selective recompute
// (d9d::recompute::Attention) wraps only that part, so the rest keeps its activations. Qwen3's
// decoder layers declare Part::attention: the input norm, the projections, the attention and the
// output projection, from the block's input to the residual branch's output.
#pragma once

#include <array>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::model {

class Block {
 public:
  /// The block's computation on its input (called once per forward, again under recompute).
  using Body = std::function<at::Tensor(const at::Tensor&)>;
  /// Runs the body (e.g. checkpointed); must call it with the input and return what it returns.
  using Wrapper = std::function<at::Tensor(const at::Tensor& input, const Body& body)>;
  /// A named part of the body, run through run_part.
  enum class Part : unsigned char { attention };

  Block() = default;
  virtual ~Block() = default;
  Block(const Block&) = default;
  Block& operator=(const Block&) = default;
  Block(Block&&) = default;
  Block& operator=(Block&&) = default;

  /// Called before the body, in the order added.
  void add_forward_pre_hook(std::function<void()> hook);
  /// Called with the body's output, in the order added; each returns the output to pass on (the
  /// same tensor, or one that autograd tracks through a function of the hook's own).
  void add_forward_post_hook(std::function<at::Tensor(const at::Tensor&)> hook);
  /// Replaces how the body runs (at most one wrapper; empty: directly).
  void set_body_wrapper(Wrapper wrapper);
  /// Replaces how `part` runs (at most one wrapper per part; empty: directly). Throws
  /// std::invalid_argument when the block does not declare `part`.
  void set_part_wrapper(Part part, Wrapper wrapper);
  /// Whether the block's body runs `part` through run_part.
  [[nodiscard]] bool has_part(Part part) const;
  /// Drops every hook and every wrapper.
  void clear_block_hooks();
  [[nodiscard]] bool has_block_hooks() const;

 protected:
  /// Pre-hooks, body(x) (through the wrapper when set), post-hooks.
  at::Tensor run_block(const at::Tensor& x, const Body& body);
  /// States that the body runs `part` through run_part (call in the constructor).
  void declare_part(Part part);
  /// body(x) through the part's wrapper when set; captures by value, as run_block's body.
  at::Tensor run_part(Part part, const at::Tensor& x, const Body& body);

 private:
  static constexpr int kParts = 1;
  std::vector<std::function<void()>> pre_hooks_;
  std::vector<std::function<at::Tensor(const at::Tensor&)>> post_hooks_;
  Wrapper wrapper_;
  std::array<bool, kParts> declared_{};
  std::array<Wrapper, kParts> part_wrappers_;
};

}  // namespace d9d::model
