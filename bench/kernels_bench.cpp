// bench/kernels_bench.cpp — d9d's fused ops against the ATen compositions they replace, as achieved
// GB/s (rope, silu_mul) and time per step (AdamW): what the layers and the optimizer run.
//
//   kernels_bench                                 # CUDA (bf16 activations) when available, else
//   CPU kernels_bench --benchmark_filter=Rope
//
// Bytes counted are the minimum each call must move. rope: read x, write y (the small tables not
// counted); forward+backward adds reading dy and writing dx. silu_mul: forward reads gate and up,
// writes h; backward reads dh, gate and up, writes dgate and dup. On the H200 (~4.8 TB/s HBM),
// memory-bound kernels reach ~85-90% of it at best. AdamW: one step over the 310 parameters of a
// Qwen3-0.6B shape (fp32), torch::optim::AdamW (a dozen kernels per parameter) against
// d9d::optim::FusedAdamW (one multi-tensor kernel per group); on bfloat16 parameters,
// d9d::optim::StochasticAdamW (float32 or bfloat16 moments) against ATen's fused AdamW (round to
// nearest, bfloat16 moments). copy_stochastic_: float32 → bfloat16 against a plain copy_. The
// gradient clipping's scale over the same shape's bfloat16 gradients: d9d::scale_ (one launch,
// float32 scale) against at::_foreach_mul_ with the float32 scale (one multiply per tensor: the
// route it takes when the scale's dtype differs) and with a bfloat16 scale (its multi-tensor
// route, the scale rounded to 8 bits: the bound).
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <d9d/kernels/cross_entropy.hpp>
#include <d9d/kernels/rope.hpp>
#include <d9d/kernels/scale.hpp>
#include <d9d/kernels/silu_mul.hpp>
#include <d9d/kernels/stochastic.hpp>
#include <d9d/optim/adamw.hpp>

#include "timing.hpp"

namespace {

constexpr int kCallsPerIteration = 20;

using d9d_bench::on_cuda;
using d9d_bench::options;
using d9d_bench::run;

// ---- rope: x [B, T, H, D] -----------------------------------------------------------------------

struct RopeInputs {
  at::Tensor x, dy, cos, sin;
  double bytes = 0;
};

RopeInputs rope_inputs(const benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int64_t heads = state.range(1);
  const int64_t dim = 128;
  const int64_t seq = 2048;
  RopeInputs in;
  in.x = at::randn({tokens / seq, seq, heads, dim}, options());
  in.dy = at::randn_like(in.x);
  const auto angles = at::rand({seq, dim / 2}, options().dtype(at::kFloat)) * 6.28;
  in.cos = angles.cos();
  in.sin = angles.sin();
  in.bytes = static_cast<double>(in.x.nbytes());
  return in;
}

at::Tensor eager_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const auto c = at::cat({cos, cos}, -1).unsqueeze(1).to(x.scalar_type());
  const auto s = at::cat({sin, sin}, -1).unsqueeze(1).to(x.scalar_type());
  const auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

template <typename Rope>
void rope_forward_backward(benchmark::State& state, Rope&& rope) {
  const auto in = rope_inputs(state);
  const auto x = in.x.detach().requires_grad_(true);
  run(state, 4 * in.bytes, kCallsPerIteration, [&] {
    const auto y = rope(x, in.cos, in.sin);
    benchmark::DoNotOptimize(torch::autograd::grad({y}, {x}, {in.dy}));
  });
}

void BM_Rope_Forward_D9d(benchmark::State& state) {
  const auto in = rope_inputs(state);
  const at::NoGradGuard no_grad;
  run(state, 2 * in.bytes, kCallsPerIteration,
      [&] { benchmark::DoNotOptimize(d9d::kernels::rope(in.x, in.cos, in.sin)); });
}
void BM_Rope_Forward_AtenEager(benchmark::State& state) {
  const auto in = rope_inputs(state);
  const at::NoGradGuard no_grad;
  run(state, 2 * in.bytes, kCallsPerIteration,
      [&] { benchmark::DoNotOptimize(eager_rope(in.x, in.cos, in.sin)); });
}
void BM_Rope_ForwardBackward_D9d(benchmark::State& state) {
  rope_forward_backward(state, [](const auto& x, const auto& c, const auto& s) {
    return d9d::kernels::rope(x, c, s);
  });
}
void BM_Rope_ForwardBackward_AtenEager(benchmark::State& state) {
  rope_forward_backward(
      state, [](const auto& x, const auto& c, const auto& s) { return eager_rope(x, c, s); });
}

// ---- silu_mul: [tokens, intermediate]
// ------------------------------------------------------------

struct SiluInputs {
  at::Tensor gate, up, dh;
  double bytes = 0;  // one tensor
};

SiluInputs silu_inputs(const benchmark::State& state) {
  SiluInputs in;
  in.gate = at::randn({state.range(0), state.range(1)}, options());
  in.up = at::randn_like(in.gate);
  in.dh = at::randn_like(in.gate);
  in.bytes = static_cast<double>(in.gate.nbytes());
  return in;
}

template <typename Act>
void silu_forward_backward(benchmark::State& state, Act&& act) {
  const auto in = silu_inputs(state);
  const auto gate = in.gate.detach().requires_grad_(true);
  const auto up = in.up.detach().requires_grad_(true);
  run(state, 8 * in.bytes, kCallsPerIteration, [&] {
    const auto h = act(gate, up);
    benchmark::DoNotOptimize(torch::autograd::grad({h}, {gate, up}, {in.dh}));
  });
}

void BM_SiluMul_Forward_D9d(benchmark::State& state) {
  const auto in = silu_inputs(state);
  const at::NoGradGuard no_grad;
  run(state, 3 * in.bytes, kCallsPerIteration,
      [&] { benchmark::DoNotOptimize(d9d::kernels::silu_mul(in.gate, in.up)); });
}
void BM_SiluMul_Forward_AtenEager(benchmark::State& state) {
  const auto in = silu_inputs(state);
  const at::NoGradGuard no_grad;
  run(state, 3 * in.bytes, kCallsPerIteration,
      [&] { benchmark::DoNotOptimize(at::silu(in.gate) * in.up); });
}
void BM_SiluMul_ForwardBackward_D9d(benchmark::State& state) {
  silu_forward_backward(state,
                        [](const auto& g, const auto& u) { return d9d::kernels::silu_mul(g, u); });
}
void BM_SiluMul_ForwardBackward_AtenEager(benchmark::State& state) {
  silu_forward_backward(state, [](const auto& g, const auto& u) { return at::silu(g) * u; });
}

// ---- attention with grouped KV heads: expanded copies vs SDPA's enable_gqa
// ------------------------

template <bool Gqa>
void attention(benchmark::State& state) {
  if (!on_cuda()) {
    state.SkipWithError("attention shapes of a GPU run: CUDA only");
    return;
  }
  const int64_t batch = 4;
  const int64_t seq = 2048;
  const int64_t heads = 16;
  const int64_t kv = state.range(0);
  const int64_t dim = 128;
  // [B, T, H, D] storage seen as [B, H, T, D], as the model's projections give them.
  const auto q =
      at::randn({batch, seq, heads, dim}, options()).transpose(1, 2).requires_grad_(true);
  const auto k = at::randn({batch, seq, kv, dim}, options()).transpose(1, 2).requires_grad_(true);
  const auto v = at::randn({batch, seq, kv, dim}, options()).transpose(1, 2).requires_grad_(true);
  const auto dy = at::randn({batch, heads, seq, dim}, options());
  run(state, 0, 5, [&] {
    at::Tensor out;
    if constexpr (Gqa) {
      out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, std::nullopt, kv != heads);
    } else {
      const int64_t groups = heads / kv;
      const auto ke =
          k.unsqueeze(2).expand({batch, kv, groups, seq, dim}).reshape({batch, heads, seq, dim});
      const auto ve =
          v.unsqueeze(2).expand({batch, kv, groups, seq, dim}).reshape({batch, heads, seq, dim});
      out = at::scaled_dot_product_attention(q, ke, ve, {}, 0.0, true);
    }
    benchmark::DoNotOptimize(torch::autograd::grad({out}, {q, k, v}, {dy}));
  });
}

void BM_Attention_ExpandedKv(benchmark::State& state) { attention<false>(state); }
void BM_Attention_EnableGqa(benchmark::State& state) { attention<true>(state); }

// ---- AdamW over a Qwen3-0.6B shape's parameters ------------------------------------------------

std::vector<at::Tensor> qwen3_parameters(double scale, at::ScalarType dtype = at::kFloat) {
  const auto opts = options().dtype(dtype);
  const auto n = [scale](int64_t v) {
    return std::max<int64_t>(1, static_cast<int64_t>(v * scale));
  };
  std::vector<at::Tensor> params;
  params.push_back(at::randn({n(151936), 1024}, opts));
  for (int layer = 0; layer < 28; ++layer) {
    for (const auto& shape : std::vector<std::vector<int64_t>>{{n(2048), 1024},
                                                               {n(1024), 1024},
                                                               {n(1024), 1024},
                                                               {1024, n(2048)},
                                                               {n(3072), 1024},
                                                               {n(3072), 1024},
                                                               {1024, n(3072)},
                                                               {1024},
                                                               {1024},
                                                               {128},
                                                               {128}}) {
      params.push_back(at::randn(shape, opts));
    }
  }
  params.push_back(at::randn({1024}, opts));
  for (auto& p : params) {
    p.requires_grad_(true);
    p.mutable_grad() = at::randn_like(p);
  }
  return params;
}

template <typename Optimizer>
void adamw(benchmark::State& state) {
  auto params = qwen3_parameters(on_cuda() ? 1.0 : 0.01);
  Optimizer optimizer(params, torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  double bytes = 0;
  for (const auto& p : params) {
    bytes += 4.0 * static_cast<double>(p.nbytes());  // read p, g, m, v; write p, m, v: ~7 passes
  }
  run(state, bytes * 7.0 / 4.0, 3, [&] { optimizer.step(); });
}

void BM_AdamW_Torch(benchmark::State& state) { adamw<torch::optim::AdamW>(state); }
void BM_AdamW_D9dFused(benchmark::State& state) { adamw<d9d::optim::FusedAdamW>(state); }

// bfloat16 parameters and gradients. Bytes per element: read p (2), g (2), m and v (4 each in
// float32, 2 in bfloat16); write p, m and v: 22 with float32 moments, 14 with bfloat16 ones.
template <typename Make>
void adamw_bf16(benchmark::State& state, double bytes_per_element, Make&& make) {
  auto params = qwen3_parameters(on_cuda() ? 1.0 : 0.01, at::kBFloat16);
  auto optimizer = make(params);
  double elements = 0;
  for (const auto& p : params) {
    elements += static_cast<double>(p.numel());
  }
  run(state, elements * bytes_per_element, 3, [&] { optimizer->step(); });
}

void BM_AdamW_D9dStochastic_Fp32Moments(benchmark::State& state) {
  adamw_bf16(state, 22, [](std::vector<at::Tensor>& p) {
    return std::make_unique<d9d::optim::StochasticAdamW>(
        std::vector{torch::optim::OptimizerParamGroup(p)},
        torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  });
}
// The same update on one large tensor (the "large tensors" figure; the list above mixes
// the 155M-element embedding with 1024-element norms): 600 Mi elements on the GPU.
void BM_AdamW_D9dStochastic_Fp32Moments_OneTensor(benchmark::State& state) {
  const int64_t n = on_cuda() ? int64_t{600} << 20 : int64_t{1} << 20;
  std::vector<at::Tensor> params{at::randn({n}, options().dtype(at::kBFloat16))};
  params[0].requires_grad_(true);
  params[0].mutable_grad() = at::randn_like(params[0]);
  d9d::optim::StochasticAdamW optimizer(std::vector{torch::optim::OptimizerParamGroup(params)},
                                        torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  run(state, 22.0 * static_cast<double>(n), 3, [&] { optimizer.step(); });
}
void BM_AdamW_D9dStochastic_Bf16Moments(benchmark::State& state) {
  adamw_bf16(state, 14, [](std::vector<at::Tensor>& p) {
    return std::make_unique<d9d::optim::StochasticAdamW>(
        std::vector{torch::optim::OptimizerParamGroup(p)},
        torch::optim::AdamWOptions(1e-4).weight_decay(0.1),
        d9d::optim::StochasticOptions{.state_dtype = at::kBFloat16});
  });
}
void BM_AdamW_AtenFused_Bf16Nearest(benchmark::State& state) {  // torch's fused AdamW, bf16
  adamw_bf16(state, 14, [](std::vector<at::Tensor>& p) {
    return std::make_unique<d9d::optim::FusedAdamW>(
        p, torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
  });
}

// Cross-entropy over [rows × 151936] logits (Qwen3's vocabulary) with the gradient left over them:
// at least one read and one write of the logits (the kernel's second read mostly hits L2).
void BM_CrossEntropyRows_D9d(benchmark::State& state) {
  const auto logits = at::randn({state.range(0), 151936}, options()) * 3;
  const auto labels = at::randint(0, 151936, {state.range(0)}, options().dtype(at::kLong));
  auto work = logits.clone();
  run(state, 2.0 * static_cast<double>(logits.nbytes()), kCallsPerIteration, [&] {
    work.copy_(logits);  // the kernel overwrites its input; the copy is timed in both
    (void)d9d::kernels::cross_entropy_rows(work, labels, -100);
  });
}
void BM_CrossEntropyRows_AtenEager(benchmark::State& state) {
  // What model::linear_cross_entropy ran before the op: upcast, log-sum-exp, gather, softmax,
  // minus one-hot, downcast.
  const auto logits = at::randn({state.range(0), 151936}, options()) * 3;
  const auto labels = at::randint(0, 151936, {state.range(0)}, options().dtype(at::kLong));
  auto work = logits.clone();
  run(state, 2.0 * static_cast<double>(logits.nbytes()), kCallsPerIteration, [&] {
    work.copy_(logits);
    auto probs = work.to(at::kFloat);
    const auto lse = at::logsumexp(probs, 1);
    const auto loss = (lse - probs.gather(1, labels.unsqueeze(1)).squeeze(1)).sum();
    probs.sub_(lse.unsqueeze(1)).exp_();
    probs.scatter_add_(1, labels.unsqueeze(1), at::full({probs.size(0), 1}, -1.0, probs.options()));
    work.copy_(probs);
  });
}

// float32 → bfloat16 over {elements}: read 4 bytes, write 2 per element.
void BM_CopyStochastic(benchmark::State& state) {
  const auto src = at::randn({state.range(0)}, options().dtype(at::kFloat));
  auto dst = at::empty({state.range(0)}, options().dtype(at::kBFloat16));
  run(state, 6.0 * static_cast<double>(state.range(0)), kCallsPerIteration,
      [&] { d9d::kernels::copy_stochastic(dst, src, 1); });
}
void BM_CopyNearest_Aten(benchmark::State& state) {
  const auto src = at::randn({state.range(0)}, options().dtype(at::kFloat));
  auto dst = at::empty({state.range(0)}, options().dtype(at::kBFloat16));
  run(state, 6.0 * static_cast<double>(state.range(0)), kCallsPerIteration,
      [&] { dst.copy_(src); });
}

// ---- The clipping's scale over a Qwen3-0.6B shape's bfloat16 gradients --------------------------

// Read and write 2 bytes per element.
template <typename Scale>
void clip_scale(benchmark::State& state, Scale&& scale) {
  const auto params = qwen3_parameters(on_cuda() ? 1.0 : 0.01, at::kBFloat16);
  std::vector<at::Tensor> grads;
  double bytes = 0;
  for (const auto& p : params) {
    grads.push_back(p.grad());
    bytes += 2.0 * static_cast<double>(p.grad().nbytes());
  }
  // A scale of one keeps the gradients' values (and the timing) the same from call to call.
  const auto factor = at::ones({}, options().dtype(at::kFloat));
  run(state, bytes, kCallsPerIteration, [&] { scale(grads, factor); });
}
void BM_ClipScale_D9d(benchmark::State& state) {
  clip_scale(state, [](const std::vector<at::Tensor>& g, const at::Tensor& s) {
    d9d::kernels::scale(g, s);
  });
}
void BM_ClipScale_AtenForeachMul(benchmark::State& state) {
  clip_scale(state, [](const std::vector<at::Tensor>& g, const at::Tensor& s) {
    at::_foreach_mul_(g, s);
  });
}
void BM_ClipScale_AtenForeachMul_Bf16Scale(benchmark::State& state) {
  clip_scale(state, [](const std::vector<at::Tensor>& g, const at::Tensor& s) {
    at::_foreach_mul_(g, s.to(at::kBFloat16));
  });
}

void rope_shapes(benchmark::internal::Benchmark* b) {
  // {tokens, heads}: 8 x 2048 tokens with Qwen3-0.6B's 16 query and 8 KV heads, and 8B's 32.
  if (on_cuda()) {
    b->Args({16384, 16})->Args({16384, 8})->Args({16384, 32});
  } else {
    b->Args({2048, 4});
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void silu_shapes(benchmark::internal::Benchmark* b) {
  // {tokens, intermediate}: 8 x 2048 tokens at Qwen3-0.6B (3072) and 8B (12288).
  if (on_cuda()) {
    b->Args({16384, 3072})->Args({16384, 12288});
  } else {
    b->Args({1024, 1024});
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Rope_Forward_D9d)->Apply(rope_shapes);
BENCHMARK(BM_Rope_Forward_AtenEager)->Apply(rope_shapes);
BENCHMARK(BM_Rope_ForwardBackward_D9d)->Apply(rope_shapes);
BENCHMARK(BM_Rope_ForwardBackward_AtenEager)->Apply(rope_shapes);
BENCHMARK(BM_SiluMul_Forward_D9d)->Apply(silu_shapes);
BENCHMARK(BM_SiluMul_Forward_AtenEager)->Apply(silu_shapes);
BENCHMARK(BM_SiluMul_ForwardBackward_D9d)->Apply(silu_shapes);
BENCHMARK(BM_SiluMul_ForwardBackward_AtenEager)->Apply(silu_shapes);
BENCHMARK(BM_Attention_ExpandedKv)->Arg(8)->Arg(16)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Attention_EnableGqa)->Arg(8)->Arg(16)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_Torch)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_D9dFused)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_D9dStochastic_Fp32Moments)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_D9dStochastic_Fp32Moments_OneTensor)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_D9dStochastic_Bf16Moments)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW_AtenFused_Bf16Nearest)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CrossEntropyRows_D9d)
    ->Arg(on_cuda() ? 2048 : 8)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CrossEntropyRows_AtenEager)
    ->Arg(on_cuda() ? 2048 : 8)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CopyStochastic)
    ->Arg(on_cuda() ? int64_t{1} << 28 : int64_t{1} << 20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CopyNearest_Aten)
    ->Arg(on_cuda() ? int64_t{1} << 28 : int64_t{1} << 20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClipScale_D9d)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClipScale_AtenForeachMul)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClipScale_AtenForeachMul_Bf16Scale)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
