// d9d/model/block.cpp — hooks around a block's forward.
#include <d9d/model/block.hpp>

namespace d9d::model {

void Block::add_forward_pre_hook(std::function<void()> hook) {
  pre_hooks_.push_back(std::move(hook));
}

void Block::add_forward_post_hook(std::function<at::Tensor(const at::Tensor&)> hook) {
  post_hooks_.push_back(std::move(hook));
}

void Block::set_body_wrapper(Wrapper wrapper) { wrapper_ = std::move(wrapper); }

void Block::clear_block_hooks() {
  pre_hooks_.clear();
  post_hooks_.clear();
  wrapper_ = nullptr;
}

bool Block::has_block_hooks() const {
  return !pre_hooks_.empty() || !post_hooks_.empty() || static_cast<bool>(wrapper_);
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

}  // namespace d9d::model
