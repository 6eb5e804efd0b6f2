// bench/moe_layer_bench.cpp — one MoE layer's forward + backward (d9d::model::MoeLayer) with the
// grouped GEMM (at::_grouped_mm) against the per-expert loop, on one device. Default shape: a
// Qwen3-30B-A3B layer (hidden 2048, 128 experts, top 8, expert size 768), 8192 tokens, bf16.
//
//   moe_layer_bench --device cuda --tokens 8192 --iters 20
//   (bench/hf_moe_block_bench.py times transformers' Qwen3MoeSparseMoeBlock on the same shape)
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <d9d/model/moe.hpp>

#include "timing.hpp"

int main(int argc, char** argv) {
  CLI::App app{"MoE layer forward + backward: grouped GEMM vs per-expert loop"};
  std::string device = "cuda";
  std::string dtype_name = "bf16";
  int64_t tokens = 8192;
  int64_t hidden = 2048;
  int64_t experts = 128;
  int64_t top_k = 8;
  int64_t intermediate = 768;
  int iters = 20;
  app.add_option("--device", device);
  app.add_option("--dtype", dtype_name)->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--tokens", tokens);
  app.add_option("--hidden", hidden);
  app.add_option("--experts", experts);
  app.add_option("--top-k", top_k);
  app.add_option("--intermediate", intermediate);
  app.add_option("--iters", iters);
  CLI11_PARSE(app, argc, argv);
  const auto dtype = dtype_name == "bf16" ? at::kBFloat16 : at::kFloat;
  const auto options = at::TensorOptions().dtype(dtype).device(c10::Device(device));

  at::manual_seed(0);
  d9d::model::MoeLayer layer(d9d::model::MoeOptions{.hidden_size = hidden,
                                                    .num_experts = experts,
                                                    .top_k = top_k,
                                                    .intermediate_size = intermediate,
                                                    .norm_topk_prob = true},
                             0);
  layer->to(options.device(), dtype);
  const auto x = (at::randn({tokens, hidden}, options)).requires_grad_();
  // Forward + backward FLOPs of the experts a token uses (3 matmuls of 2 h i, times 3 for
  // forward + backward) and of the router.
  const double flops = 3.0 * static_cast<double>(tokens) *
                       (2.0 * static_cast<double>(top_k) * 3.0 * static_cast<double>(hidden) *
                            static_cast<double>(intermediate) +
                        2.0 * static_cast<double>(hidden * experts));
  std::printf(
      "MoE layer: %ld tokens, hidden %ld, %ld experts, top %ld, expert size %ld, %s on %s\n",
      static_cast<long>(tokens), static_cast<long>(hidden), static_cast<long>(experts),
      static_cast<long>(top_k), static_cast<long>(intermediate), dtype_name.c_str(),
      device.c_str());
  for (const auto gemm : {d9d::model::GroupedGemm::grouped_mm, d9d::model::GroupedGemm::loop}) {
    layer->experts->gemm = gemm;
    const auto step = [&] {
      layer->zero_grad();
      x.mutable_grad() = at::Tensor();
      const auto y = layer(x);
      y.to(at::kFloat).square().mean().backward();
      return x.grad().to(at::kFloat).abs().sum().item<double>();  // waits for the device
    };
    for (int i = 0; i < 3; ++i) {
      (void)step();
    }
    const d9d_bench::Stopwatch watch;
    double check = 0;
    for (int i = 0; i < iters; ++i) {
      check = step();
    }
    const double seconds = watch.seconds() / iters;
    std::printf("%-11s forward+backward %8.2f ms  %8.1f TFLOP/s  (|dx| sum %.4g)\n",
                gemm == d9d::model::GroupedGemm::grouped_mm ? "grouped_mm" : "loop", seconds * 1e3,
                flops / seconds / 1e12, check);
  }
  return 0;
}
