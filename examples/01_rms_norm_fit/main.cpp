// examples/01_rms_norm_fit — the smallest end-to-end run: a tiny model built around the d9d custom
// op `d9d::rms_norm` learns a fixed random regression on CPU (or CUDA when available), with
// gradients flowing through the op's own backward kernel. Exits 1 unless the loss falls 10-fold.
//
//   bazel run //examples/01_rms_norm_fit        (tools/demo runs it)
#include <cstdio>

#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <d9d/kernels/rms_norm.hpp>
#include <d9d/train/main.hpp>

namespace {

int fit() {
  // ---- configuration -------------------------------------------------------------------------
  constexpr int64_t kHidden = 32;
  constexpr int64_t kBatch = 4096;
  constexpr int kSteps = 300;
  constexpr double kLearningRate = 3e-3;
  // ---------------------------------------------------------------------------------------------
  torch::manual_seed(0);
  const auto device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;

  // The target: a smooth function of two random projections (not exactly representable).
  const auto inputs = torch::randn({kBatch, kHidden});
  const auto a = torch::randn({kHidden, 1}) / 8.0;
  const auto b = torch::randn({kHidden, 1}) / 8.0;
  const auto targets = torch::sin(inputs.mm(a) * 3.0) + 0.5 * torch::cos(inputs.mm(b) * 2.0);

  // The student: Linear -> RMSNorm (d9d op) -> ReLU -> Linear.
  torch::nn::Linear proj_in(kHidden, kHidden);
  torch::nn::Linear proj_out(kHidden, 1);
  auto norm_weight = torch::ones({kHidden}, torch::requires_grad());
  proj_in->to(device);
  proj_out->to(device);
  norm_weight = norm_weight.to(device).detach().requires_grad_(true);
  const auto x = inputs.to(device);
  const auto y = targets.to(device);

  std::vector<torch::Tensor> params = proj_in->parameters();
  for (const auto& p : proj_out->parameters()) {
    params.push_back(p);
  }
  params.push_back(norm_weight);
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(kLearningRate));

  double first = 0.0;
  double last = 0.0;
  for (int step = 1; step <= kSteps; ++step) {
    optimizer.zero_grad();
    const auto hidden = d9d::kernels::rms_norm(proj_in(x), norm_weight, 1e-6);
    const auto loss = torch::mse_loss(proj_out(torch::relu(hidden)), y);
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (step == 1) {
      first = last;
    }
    if (step == 1 || step % 50 == 0) {
      std::printf("step %4d/%d  loss %.3e\n", step, kSteps, last);
    }
  }
  std::printf("device %s: loss %.3e -> %.3e (%.0fx lower)\n",
              device == torch::kCUDA ? "cuda" : "cpu", first, last, first / last);
  return last * 10.0 < first ? 0 : 1;
}

}  // namespace

// Any error (a LibTorch one included) is printed as one line and the exit status is 1, not an
// abort.
int main(int argc, char** argv) { return d9d::run_main(argc, argv, fit); }
