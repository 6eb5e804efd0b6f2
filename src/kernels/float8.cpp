// d9d/kernels/float8.cpp — the schema of d9d::float8_quantize, its CPU reference kernel (the
// definition in d9d/kernels/float8.hpp, element by element), and the float8 matrix product; the
// sharded per-tensor quantisation's CPU kernels (d9d/kernels/float8_sharded.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <d9d/kernels/float8.hpp>
#include <d9d/kernels/float8_sharded.hpp>

namespace d9d::kernels {
namespace {

bool is_float8(at::ScalarType type) {
  return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

}  // namespace

float float8_max(at::ScalarType format) {
  TORCH_CHECK(is_float8(format),
              "d9d::float8_quantize: the format is Float8_e4m3fn or Float8_e5m2, got ", format);
  return format == at::kFloat8_e4m3fn ? 448.0F : 57344.0F;
}

namespace detail {

float float8_scale(float amax, float format_max) {
  const float a = amax < 1e-12F ? 1e-12F : amax;  // NaN stays NaN
  const float s = format_max / a;
  if (!(s > 0.0F)) {
    return std::numeric_limits<float>::quiet_NaN();  // a NaN or infinite group becomes NaN
  }
  std::uint32_t bits = 0;
  std::memcpy(&bits, &s, sizeof bits);
  bits &= 0xFF800000U;  // sign and exponent: the power of two at or below s
  float out = 0.0F;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

bool is_column_factor(const at::Tensor& x, const at::Tensor& x_scale) {
  return x_scale.defined() && !is_float8(x.scalar_type());
}

void check_float8_quantize(const at::Tensor& x, const at::Tensor& x_scale, at::ScalarType format,
                           bool rowwise, bool transpose) {
  TORCH_CHECK(x.defined() && x.dim() == 2, "d9d::float8_quantize: x must be 2-D, got ",
              x.defined() ? x.dim() : -1, " dimensions");
  static_cast<void>(float8_max(format));
  const auto type = x.scalar_type();
  const bool float8_input = is_float8(type);
  TORCH_CHECK(float8_input || type == at::kFloat || type == at::kDouble || type == at::kBFloat16 ||
                  type == at::kHalf,
              "d9d::float8_quantize: x is float32, float64, bfloat16, float16 or float8, got ",
              type);
  TORCH_CHECK(!float8_input || x_scale.defined(),
              "d9d::float8_quantize: a float8 x needs its scale (x_scale)");
  if (!x_scale.defined()) {
    return;
  }
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat, "d9d::float8_quantize: x_scale is float32");
  TORCH_CHECK(x_scale.device() == x.device(), "d9d::float8_quantize: x_scale is on ",
              x_scale.device(), ", x on ", x.device());
  if (float8_input) {
    TORCH_CHECK(x_scale.dim() == 0 ||
                    (x_scale.dim() == 2 && x_scale.size(0) == x.size(0) && x_scale.size(1) == 1),
                "d9d::float8_quantize: a float8 x's x_scale is [rows, 1] or 0-dimensional, got ",
                x_scale.sizes(), " for x ", x.sizes());
    return;
  }
  TORCH_CHECK(x_scale.dim() == 2 && x_scale.size(0) == 1 && x_scale.size(1) == x.size(1),
              "d9d::float8_quantize: x_scale of a non-float8 x is a factor per column [1, cols], "
              "got ",
              x_scale.sizes(), " for x ", x.sizes());
  TORCH_CHECK(rowwise && !transpose,
              "d9d::float8_quantize: a factor per column (x_scale) takes per-row scales, not "
              "transposed");
}

void check_float8_with_amax(const at::Tensor& x, const at::Tensor& amax_bits,
                            at::ScalarType format) {
  check_float8_quantize(x, at::Tensor(), format, false, false);
  TORCH_CHECK(!is_float8(x.scalar_type()),
              "d9d::float8_amax_bits / float8_quantize_with_amax: x is not float8");
  if (!amax_bits.defined()) {
    return;
  }
  TORCH_CHECK(amax_bits.scalar_type() == at::kInt && amax_bits.numel() == 1,
              "d9d::float8_quantize_with_amax: amax_bits is one int32 (float8_amax_bits' form), "
              "got ",
              amax_bits.scalar_type(), " ", amax_bits.sizes());
  TORCH_CHECK(amax_bits.device() == x.device(), "d9d::float8_quantize_with_amax: amax_bits is on ",
              amax_bits.device(), ", x on ", x.device());
}

}  // namespace detail

namespace {

// The definition's maximum: NaN wins (a NaN element makes its group NaN); otherwise the larger.
float nan_max(float m, float a) { return (std::isnan(a) || a > m) && !std::isnan(m) ? a : m; }

// A float's bits as the int32 float8_amax_bits holds, and back.
int32_t bits_of(float f) {
  int32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}
float float_of(int32_t bits) {
  float f = 0.0F;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x as float32 values, row-major [rows, cols] (a float8 x times its scale; another x times its
// factor per column).
std::vector<float> values_of(const at::Tensor& x, const at::Tensor& x_scale) {
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  const bool factor_given = detail::is_column_factor(x, x_scale);
  if (x_scale.defined() && !factor_given) {
    const auto raw = x.contiguous();
    const auto scale = x_scale.contiguous();
    const float* s = scale.const_data_ptr<float>();
    const bool per_row = scale.dim() == 2;
    const auto read = [&](auto tag) {
      using T = decltype(tag);
      const T* q = static_cast<const T*>(raw.const_data_ptr());
      for (int64_t r = 0; r < rows; ++r) {
        const float factor = s[per_row ? r : 0];
        for (int64_t c = 0; c < cols; ++c) {
          v[static_cast<std::size_t>(r * cols + c)] = static_cast<float>(q[r * cols + c]) * factor;
        }
      }
    };
    if (x.scalar_type() == at::kFloat8_e4m3fn) {
      read(c10::Float8_e4m3fn());
    } else {
      read(c10::Float8_e5m2());
    }
    return v;
  }
  const auto f = x.to(at::kFloat).contiguous();
  std::memcpy(v.data(), f.const_data_ptr<float>(), v.size() * sizeof(float));
  if (factor_given) {
    const auto factor = x_scale.contiguous();
    const float* m = factor.const_data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        v[static_cast<std::size_t>(r * cols + c)] *= m[c];
      }
    }
  }
  return v;
}

template <class Format>
void write_quantized(const std::vector<float>& v, int64_t rows, int64_t cols, bool transpose,
                     const std::vector<float>& group_scale, bool rowwise, float format_max,
                     at::Tensor& out) {
  auto* q = static_cast<Format*>(out.mutable_data_ptr());
  const int64_t out_cols = transpose ? rows : cols;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t out_row = transpose ? c : r;
        const int64_t out_col = transpose ? r : c;
        const float s = group_scale[static_cast<std::size_t>(rowwise ? out_row : 0)];
        float y = v[static_cast<std::size_t>(r * cols + c)] * s;
        y = y > format_max ? format_max : (y < -format_max ? -format_max : y);  // NaN stays
        q[out_row * out_cols + out_col] = Format(y);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> float8_quantize_cpu(const at::Tensor& x,
                                                       const std::optional<at::Tensor>& x_scale_arg,
                                                       at::ScalarType format, bool rowwise,
                                                       bool transpose) {
  const at::Tensor x_scale = x_scale_arg.value_or(at::Tensor());
  detail::check_float8_quantize(x, x_scale, format, rowwise, transpose);
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  const float format_max = float8_max(format);
  const auto v = values_of(x, x_scale);
  const int64_t groups = rowwise ? (transpose ? cols : rows) : 1;
  std::vector<float> amax(static_cast<std::size_t>(groups), 0.0F);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      auto& m = amax[static_cast<std::size_t>(rowwise ? (transpose ? c : r) : 0)];
      m = nan_max(m, std::abs(v[static_cast<std::size_t>(r * cols + c)]));
    }
  }
  std::vector<float> scale(amax.size());
  auto inverse = rowwise ? at::empty({groups, 1}, x.options().dtype(at::kFloat))
                         : at::empty({}, x.options().dtype(at::kFloat));
  float* inv = inverse.mutable_data_ptr<float>();
  for (std::size_t g = 0; g < amax.size(); ++g) {
    scale[g] = detail::float8_scale(amax[g], format_max);
    inv[g] = 1.0F / scale[g];
  }
  auto out =
      at::empty(transpose ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{rows, cols},
                x.options().dtype(format));
  if (format == at::kFloat8_e4m3fn) {
    write_quantized<c10::Float8_e4m3fn>(v, rows, cols, transpose, scale, rowwise, format_max, out);
  } else {
    write_quantized<c10::Float8_e5m2>(v, rows, cols, transpose, scale, rowwise, format_max, out);
  }
  return {out, inverse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> float8_quantize_both_cpu(
    const at::Tensor& x, at::ScalarType format, bool rowwise,
    const std::optional<at::Tensor>& rows_factor) {
  TORCH_CHECK(!is_float8(x.scalar_type()),
              "d9d::float8_quantize_both: x is not float8 (use float8_quantize with its scale)");
  auto [rows, row_scale] = float8_quantize_cpu(x, rows_factor, format, rowwise, false);
  auto [columns, column_scale] = float8_quantize_cpu(x, std::nullopt, format, rowwise, true);
  return {rows, row_scale, columns, column_scale};
}

at::Tensor float8_amax_bits_cpu(const at::Tensor& x) {
  detail::check_float8_with_amax(x, at::Tensor(), at::kFloat8_e4m3fn);
  float m = 0.0F;
  for (const float v : values_of(x, at::Tensor())) {
    m = nan_max(m, std::abs(v));
  }
  // A NaN as the quiet NaN 0x7FC00000 (the CUDA kernels keep the input's payload, sign cleared:
  // either lies above infinity, which is all the maximum over ranks needs).
  return at::full({}, std::isnan(m) ? int32_t{0x7FC00000} : bits_of(m),
                  x.options().dtype(at::kInt));
}

std::tuple<at::Tensor, at::Tensor> float8_quantize_with_amax_cpu(const at::Tensor& x,
                                                                 const at::Tensor& amax_bits,
                                                                 at::ScalarType format) {
  detail::check_float8_with_amax(x, amax_bits, format);
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  const float format_max = float8_max(format);
  const std::vector<float> scale = {
      detail::float8_scale(float_of(amax_bits.item<int32_t>()), format_max)};
  auto out = at::empty({rows, cols}, x.options().dtype(format));
  const auto v = values_of(x, at::Tensor());
  if (format == at::kFloat8_e4m3fn) {
    write_quantized<c10::Float8_e4m3fn>(v, rows, cols, false, scale, false, format_max, out);
  } else {
    write_quantized<c10::Float8_e5m2>(v, rows, cols, false, scale, false, format_max, out);
  }
  return {out, at::full({}, 1.0F / scale[0], x.options().dtype(at::kFloat))};
}

at::Tensor float8_transpose_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && is_float8(x.scalar_type()),
              "d9d::float8_transpose: x is a 2-D float8 tensor, got ", x.scalar_type(), " with ",
              x.dim(), " dimensions");
  // The bytes, moved as bytes.
  return x.view(at::kByte).t().contiguous().view(x.scalar_type());
}

using QuantizeSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                       const std::optional<at::Tensor>&,
                                                       at::ScalarType, bool, bool);

const c10::TypedOperatorHandle<QuantizeSig>& quantize_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::float8_quantize", "")
                                 .typed<QuantizeSig>();
  return handle;
}

using QuantizeBothSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, at::ScalarType, bool, const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<QuantizeBothSig>& quantize_both_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::float8_quantize_both", "")
                                 .typed<QuantizeBothSig>();
  return handle;
}

using TensorToTensorSig = at::Tensor(const at::Tensor&);  // float8_transpose, float8_amax_bits
using WithAmaxSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       at::ScalarType);

const c10::TypedOperatorHandle<TensorToTensorSig>& amax_bits_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::float8_amax_bits", "")
                                 .typed<TensorToTensorSig>();
  return handle;
}

const c10::TypedOperatorHandle<WithAmaxSig>& with_amax_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::float8_quantize_with_amax", "")
                                 .typed<WithAmaxSig>();
  return handle;
}

const c10::TypedOperatorHandle<TensorToTensorSig>& transpose_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("d9d::float8_transpose", "")
                                 .typed<TensorToTensorSig>();
  return handle;
}

bool multiple_of_16(int64_t n) { return n % 16 == 0; }

}  // namespace

Float8Tensor float8_quantize(const at::Tensor& x, at::ScalarType format, bool rowwise,
                             bool transpose, const at::Tensor& x_scale) {
  auto [data, scale] =
      quantize_op().call(x, x_scale.defined() ? std::optional<at::Tensor>(x_scale) : std::nullopt,
                         format, rowwise, transpose);
  return {.data = std::move(data), .scale = std::move(scale)};
}

std::pair<Float8Tensor, Float8Tensor> float8_quantize_both(const at::Tensor& x,
                                                           at::ScalarType format, bool rowwise,
                                                           const at::Tensor& rows_factor) {
  auto [rows, row_scale, columns, column_scale] = quantize_both_op().call(
      x, format, rowwise,
      rows_factor.defined() ? std::optional<at::Tensor>(rows_factor) : std::nullopt);
  return {Float8Tensor{.data = std::move(rows), .scale = std::move(row_scale)},
          Float8Tensor{.data = std::move(columns), .scale = std::move(column_scale)}};
}

Float8Tensor float8_transpose(const Float8Tensor& t, bool unit_scales) {
  TORCH_CHECK(unit_scales || !t.rowwise(),
              "d9d::float8_transpose: a per-row float8 tensor transposes with unit scales only "
              "(its row scales go to the other operand)");
  auto data = transpose_op().call(t.data);
  auto scale = unit_scales ? at::ones({data.size(0), 1}, t.scale.options()) : t.scale;
  return {.data = std::move(data), .scale = std::move(scale)};
}

at::Tensor float8_amax_bits(const at::Tensor& x) { return amax_bits_op().call(x); }

Float8Tensor float8_quantize_with_amax(const at::Tensor& x, const at::Tensor& amax_bits,
                                       at::ScalarType format) {
  auto [data, scale] = with_amax_op().call(x, amax_bits, format);
  return {.data = std::move(data), .scale = std::move(scale)};
}

at::Tensor float8_dequantize(const Float8Tensor& t, at::ScalarType dtype) {
  return t.data.to(dtype).mul_(t.scale.to(dtype));
}

at::Tensor float8_matmul(const Float8Tensor& a, const Float8Tensor& b, at::ScalarType out_dtype,
                         bool fast_accum) {
  TORCH_CHECK(a.data.dim() == 2 && b.data.dim() == 2 && a.data.size(1) == b.data.size(1),
              "d9d::float8_matmul: a [M, K] and b [N, K], got ", a.data.sizes(), " and ",
              b.data.sizes());
  TORCH_CHECK(a.rowwise() == b.rowwise(),
              "d9d::float8_matmul: both operands scaled per row, or both per tensor");
  const int64_t k = a.data.size(1);
  const int64_t n = b.data.size(0);
  if (a.data.is_cuda() && multiple_of_16(k) && multiple_of_16(n)) {
    // at::_scaled_mm takes the second operand column-major: b^T as a view of b's rows.
    const auto scale_b = b.rowwise() ? b.scale.view({1, n}) : b.scale;
    // Per-row scales give bfloat16 only; per-tensor ones float32, bfloat16 or float16 too.
    const bool direct = !a.rowwise() && (out_dtype == at::kFloat || out_dtype == at::kBFloat16 ||
                                         out_dtype == at::kHalf);
    const auto out = direct ? out_dtype : at::kBFloat16;
    auto y = at::_scaled_mm(a.data, b.data.t(), a.scale, scale_b, std::nullopt, std::nullopt, out,
                            fast_accum);
    return out == out_dtype ? y : y.to(out_dtype);
  }
  const auto acc = out_dtype == at::kDouble ? at::kDouble : at::kFloat;
  return at::mm(float8_dequantize(a, acc), float8_dequantize(b, acc).t()).to(out_dtype);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def(
      "float8_quantize(Tensor x, Tensor? x_scale, ScalarType dtype, bool rowwise, bool transpose) "
      "-> (Tensor, Tensor)");
  m.def(
      "float8_quantize_both(Tensor x, ScalarType dtype, bool rowwise, Tensor? rows_factor) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def("float8_transpose(Tensor x) -> Tensor");
  m.def("float8_amax_bits(Tensor x) -> Tensor");
  m.def(
      "float8_quantize_with_amax(Tensor x, Tensor amax_bits, ScalarType dtype) -> (Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) {
  m.impl("float8_quantize", &d9d::kernels::float8_quantize_cpu);
  m.impl("float8_quantize_both", &d9d::kernels::float8_quantize_both_cpu);
  m.impl("float8_transpose", &d9d::kernels::float8_transpose_cpu);
  m.impl("float8_amax_bits", &d9d::kernels::float8_amax_bits_cpu);
  m.impl("float8_quantize_with_amax", &d9d::kernels::float8_quantize_with_amax_cpu);
}
