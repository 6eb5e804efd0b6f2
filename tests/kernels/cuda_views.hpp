// A helper of the CUDA kernel suites (GPU machines only): host tensors copied to the device as
// views `skip` elements into allocations of their own, so that with skip 1 each data pointer lies
// one element past an allocation's (16-byte aligned) start and the kernels' unaligned paths run.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace d9d::testing {

inline std::vector<at::Tensor> to_cuda_views(const std::vector<at::Tensor>& list, int64_t skip) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) {
    auto base = at::empty({t.numel() + skip}, t.options().device(at::kCUDA));
    auto view = base.narrow(0, skip, t.numel());
    view.copy_(t);
    out.push_back(view);
  }
  return out;
}

}  // namespace d9d::testing
