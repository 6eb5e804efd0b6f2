// d9d/parallel/recompute.cpp — activation recompute of d9d::model::Block bodies.
//
// A recomputed block runs its body (or, under selective recompute, its attention part) under
// no_grad in forward (only its input is kept) and, in its backward, runs it again with gradients
// on — under the autocast state its forward had — and back-propagates through that. The wrapper
// sits inside the block's hooks, so a sharding strategy's pre-backward gather (a post-forward
// hook) runs before the recomputation needs the parameters.
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/model/block.hpp>
#include <d9d/parallel/parallelize.hpp>

namespace d9d::parallel::detail {
namespace {

struct BodyHolder : torch::CustomClassHolder {
  explicit BodyHolder(model::Block::Body body_in) : body(std::move(body_in)) {}
  model::Block::Body body;
};

struct Checkpoint : torch::autograd::Function<Checkpoint> {
  // `anchor`: an empty tensor that requires a gradient, so the output does even when x does not
  // (the block's parameters still need theirs).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& /*anchor*/, const c10::IValue& body) {
    const auto device = x.device().type();
    const bool autocast = at::autocast::is_autocast_enabled(device);
    ctx->saved_data["body"] = body;
    ctx->saved_data["autocast"] = autocast;
    ctx->save_for_backward({x});
    const at::NoGradGuard no_grad;
    return c10::static_intrusive_pointer_cast<BodyHolder>(body.toCapsule())->body(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables()[0];
    const bool input_grad = saved.requires_grad();
    const auto x = saved.detach().requires_grad_(input_grad);
    const auto holder =
        c10::static_intrusive_pointer_cast<BodyHolder>(ctx->saved_data["body"].toCapsule());
    at::Tensor out;
    {
      const at::AutoGradMode enable(true);
      const ::d9d::detail::AutocastScope autocast(ctx->saved_data["autocast"].toBool(),
                                                  x.device().type());
      out = holder->body(x);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {input_grad ? x.grad() : torch::autograd::Variable(), torch::autograd::Variable(),
            torch::autograd::Variable()};
  }
};

/// The body through Checkpoint while gradients are recorded; directly otherwise (nothing to save).
at::Tensor checkpointed(const at::Tensor& x, const model::Block::Body& body) {
  if (!at::GradMode::is_enabled()) {
    return body(x);
  }
  return Checkpoint::apply(
      x,
      at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(x.device())).requires_grad_(true),
      c10::IValue::make_capsule(c10::make_intrusive<BodyHolder>(body)));
}

}  // namespace

void apply_recompute(ParallelModel& model, int every_nth, recompute::Scope scope) {
  int index = 0;
  for (const auto& module : model.modules()) {
    for (const auto& item : module->named_modules()) {
      auto* block = dynamic_cast<model::Block*>(item.value().get());
      if (block == nullptr) {
        continue;
      }
      if (index % every_nth == every_nth - 1) {
        if (scope == recompute::Scope::block) {
          block->set_body_wrapper(checkpointed);
        } else if (block->has_part(model::Block::Part::attention)) {
          block->set_part_wrapper(model::Block::Part::attention, checkpointed);
        } else {
          throw std::invalid_argument(
              "d9d::recompute::Attention: block '" + item.key() + "' (" + item.value()->name() +
              ") declares no attention part, so only its whole body can be recomputed. Fix: use "
              "d9d::recompute::Full or EveryNth<K>, or declare the part in the block "
              "(d9d::model::Block::declare_part, run_part)");
        }
      }
      ++index;
    }
  }
}

}  // namespace d9d::parallel::detail
