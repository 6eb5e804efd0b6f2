// A user program built against d9d from outside its repository (tests/consumer): the error
// handling of d9d::run_main, a batch of the user's own aggregate type split into microbatches,
// and the d9d::rms_norm custom op (registered by the library).
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/kernels/rms_norm.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/main.hpp>

namespace {

struct Batch {
  at::Tensor features;
  at::Tensor labels;
};

int check(int argc, char** /*argv*/) {
  const auto ctx = d9d::DistributedContext::local();
  const Batch batch{.features = at::ones({8, 4}), .labels = at::arange(8)};
  const std::vector<Batch> micro = d9d::split_batch(batch, 4);
  const auto y = d9d::kernels::rms_norm(micro[1].features, at::full({4}, 2.0), 0.0);
  const bool ok = micro.size() == 4 && at::equal(micro[1].labels, at::arange(2, 4)) &&
                  at::allclose(y, at::full({2, 4}, 2.0));
  ctx.logger().info(std::string("d9d consumer: ") + (ok ? "ok" : "WRONG"));
  if (argc > 1) {  // any argument: a config with a typo, which run_main reports with status 2
    (void)d9d::TrainerConfig::from_json_text(R"({"run": {"output_dir": "x", "total_step": 1}})");
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return d9d::run_main(argc, argv, check); }
