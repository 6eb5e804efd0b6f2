// The parameter type of the RMSNorm tests (CPU and CUDA): dtype, shape, tolerances.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

namespace d9d::testing {

struct RmsNormCase {
  at::ScalarType dtype;  // the input's
  std::vector<int64_t> shape;
  double rtol;
  double atol;
  at::ScalarType weight_dtype = at::ScalarType::Undefined;  // Undefined: the input's
  at::ScalarType out_dtype = at::ScalarType::Undefined;     // Undefined: the input's

  [[nodiscard]] at::ScalarType weight() const {
    return weight_dtype == at::ScalarType::Undefined ? dtype : weight_dtype;
  }
  [[nodiscard]] at::ScalarType out() const {
    return out_dtype == at::ScalarType::Undefined ? dtype : out_dtype;
  }
  /// What rms_norm takes as out_dtype: nothing when the output keeps the input's dtype.
  [[nodiscard]] std::optional<at::ScalarType> out_arg() const {
    return out_dtype == at::ScalarType::Undefined ? std::nullopt : std::optional(out_dtype);
  }
};

inline void PrintTo(const RmsNormCase& c,
                    std::ostream* out) {  // GoogleTest prints parameters with it
  *out << c10::toString(c.dtype) << " " << c10::IntArrayRef(c.shape) << " weight "
       << c10::toString(c.weight()) << " output " << c10::toString(c.out());
}

/// "BFloat16_4096_4096" (and "_wFloat", "_oBFloat16" for a weight or output dtype of its own): the
/// test-name suffix of a case.
struct RmsNormCaseName {
  template <class Info>
  std::string operator()(const Info& info) const {
    const auto& c = info.param;
    std::string name = std::string(c10::toString(c.dtype));
    for (const auto d : c.shape) {
      name += "_" + std::to_string(d);
    }
    if (c.weight() != c.dtype) {
      name += std::string("_w") + c10::toString(c.weight());
    }
    if (c.out() != c.dtype) {
      name += std::string("_o") + c10::toString(c.out());
    }
    return name;
  }
};

}  // namespace d9d::testing
