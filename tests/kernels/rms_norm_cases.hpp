// The parameter type of the RMSNorm tests (CPU and CUDA): dtype, shape, tolerances.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

namespace d9d::testing {

struct RmsNormCase {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  double rtol;
  double atol;
};

inline void PrintTo(const RmsNormCase& c,
                    std::ostream* out) {  // GoogleTest prints parameters with it
  *out << c10::toString(c.dtype) << " " << c10::IntArrayRef(c.shape);
}

/// "BFloat16_4096_4096": the test-name suffix of a case.
struct RmsNormCaseName {
  template <class Info>
  std::string operator()(const Info& info) const {
    std::string name = std::string(c10::toString(info.param.dtype));
    for (const auto d : info.param.shape) {
      name += "_" + std::to_string(d);
    }
    return name;
  }
};

}  // namespace d9d::testing
