// d9d/model/block.cpp — hooks around a block's forward.
#include <cstddef>
#include <stdexcept>
#include <utility>

#include <d9d/model/block.hpp>

namespace d9d::model {

void Block::add_forward_pre_hook(std::function<void()> hook) {
  pre_hooks_.push_back(std::move(hook));
}

void Block::add_forward_post_hook(std::function<at::Tensor(const at::Tensor&)> hook) {
  post_hooks_.push_back(std::move(hook));
}

void Block::set_body_wrapper(Wrapper wrapper) { wrapper_ = std::move(wrapper); }

void Block::set_part_wrapper(Part part, Wrapper wrapper) {
  if (!has_part(part)) {
    throw std::invalid_argument(
        "d9d::model::Block::set_part_wrapper: this block declares no such part (its body runs "
        "it whole); wrap the whole body with set_body_wrapper instead");
  }
  part_wrappers_.at(static_cast<std::size_t>(part)) = std::move(wrapper);
}

bool Block::has_part(Part part) const { return declared_.at(static_cast<std::size_t>(part)); }

void Block::declare_part(Part part) { declared_.at(static_cast<std::size_t>(part)) = true; }

void Block::clear_block_hooks() {
  pre_hooks_.clear();
  post_hooks_.clear();
  wrapper_ = nullptr;
  part_wrappers_.fill(nullptr);
}

bool Block::has_block_hooks() const {
  bool wrapped = static_cast<bool>(wrapper_);
  for (const auto& part : part_wrappers_) {
    wrapped = wrapped || static_cast<bool>(part);
  }
  return !pre_hooks_.empty() || !post_hooks_.empty() || wrapped;
}

at::Tensor Block::run_block(const at::Tensor& x, const Body& body) {
  for (const auto& hook : pre_hooks_) {
    hook();
  }
  at::Tensor out = wrapper_ ? wrapper_(x, body) : body(x);
  for (const auto& hook : post_hooks_) {
    out = hook(out);
  }
  return out;
}

at::Tensor Block::run_part(Part part, const at::Tensor& x, const Body& body) {
  const auto& wrapper = part_wrappers_.at(static_cast<std::size_t>(part));
  return wrapper ? wrapper(x, body) : body(x);
}

}  // namespace d9d::model
