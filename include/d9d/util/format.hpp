// d9d/util/format.hpp — a number as printf formats it, for log lines.
//
//   d9d::format::number(2.13456, "%.4f");   // "2.1346"
//   d9d::format::number(1.5e-4, "%.2e");    // "1.50e-04"
#pragma once

#include <array>
#include <cstdio>
#include <string>

namespace d9d::format {

/// `value` printed with one printf conversion `spec` for a double (at most 31 characters).
inline std::string number(double value, const char* spec) {
  std::array<char, 32> buffer{};
  std::snprintf(buffer.data(), buffer.size(), spec,
                value);  // NOLINT(cppcoreguidelines-pro-type-vararg)
  return {buffer.data()};
}

}  // namespace d9d::format
