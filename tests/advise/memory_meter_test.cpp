// d9d::advise::CpuMemoryMeter (d9d/advise/memory_meter.hpp): the bytes of tensors made and freed
// under it, exactly; its peak; blocks made before it are not counted; a backward's allocations are.
#include <cstdint>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <d9d/advise/memory_meter.hpp>

namespace {

TEST(Advise_CpuMemoryMeter, CountsTheBytesMadeAndFreedUnderIt) {
  const auto before = at::ones({256}, at::kFloat);  // not counted, nor its free
  d9d::advise::CpuMemoryMeter meter;
  EXPECT_EQ(meter.live(), 0);
  {
    const auto a = at::empty({1024}, at::kFloat);
    EXPECT_EQ(meter.live(), 4096);
    {
      const auto b = at::empty({10, 10}, at::kDouble);
      EXPECT_EQ(meter.live(), 4096 + 800);
    }
    EXPECT_EQ(meter.live(), 4096);
    EXPECT_EQ(meter.peak(), 4096 + 800);
    meter.reset_peak();
    EXPECT_EQ(meter.peak(), 4096);
  }
  EXPECT_EQ(meter.live(), 0);
  EXPECT_EQ(meter.peak(), 4096);
}

// y = sum(tanh(x w)): the forward keeps x w's output for tanh's backward; the backward allocates
// the gradients and frees what it kept. Whatever it allocates is seen: the peak is above the
// forward's live bytes, and after the graph is gone only the gradient remains.
TEST(Advise_CpuMemoryMeter, SeesTheForwardsSavedTensorsAndTheBackward) {
  auto x = torch::randn({64, 32});
  auto w = torch::randn({32, 16}, torch::requires_grad());
  int64_t kept = 0;
  int64_t peak = 0;
  int64_t after = 0;
  {
    d9d::advise::CpuMemoryMeter meter;
    {
      auto y = torch::tanh(torch::mm(x, w)).sum();
      kept = meter.live();
      y.backward();
      peak = meter.peak();
    }
    after = meter.live();
  }
  EXPECT_GE(kept, 64 * 16 * 4) << "tanh's output, kept for its backward";
  EXPECT_GT(peak, kept);
  EXPECT_EQ(after, static_cast<int64_t>(w.grad().nbytes())) << "only w's gradient remains";
}

}  // namespace
