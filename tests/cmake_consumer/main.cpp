// A user program built against an installed d9d (find_package(d9d)): calls the RMSNorm custom op.
#include <cstdio>

#include <ATen/ATen.h>

#include <d9d/kernels/rms_norm.hpp>

int main() {
  const auto x = at::ones({2, 4});
  const auto y = d9d::kernels::rms_norm(x, at::full({4}, 2.0), 0.0);
  const bool ok = at::allclose(y, at::full({2, 4}, 2.0));
  std::printf("find_package(d9d) consumer: rms_norm %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
