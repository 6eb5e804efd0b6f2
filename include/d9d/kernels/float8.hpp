// d9d/kernels/float8.hpp — float8 quantisation with scales computed on the device
// (`d9d::float8_quantize`) and the float8 matrix product of two quantised operands: the casts and
// GEMMs of FP8 training (d9d::precision::Float8, d9d/model/layers.hpp's float8 linear layers).
//
//   auto x8 = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, /*rowwise=*/true);
//   // x ≈ x8.data.to(at::kFloat) * x8.scale: one power-of-two scale per row, [rows, 1]
//   auto w8 = d9d::kernels::float8_quantize(w, at::kFloat8_e4m3fn, true);
//   at::Tensor y = d9d::kernels::float8_matmul(x8, w8, at::kBFloat16);  // ≈ x w^T
//
// Quantisation, by definition (the CPU kernel is this definition; the CUDA kernels reproduce it bit
// for bit): v = the input read as float32 (a float8 input: its value times its own dequantisation
// scale); for each group — each row of the output, or the whole tensor — a = max |v| over the
// group and s = 2^floor(log2(M / max(a, 1e-12))), the division in float32, M the format's
// largest finite value (448 for e4m3fn, 57344 for e5m2); q = clamp(v s, -M, M) rounded to the
// nearest float8 value (ties to even). The returned scale is 1/s (exact): x ≈ q · (1/s).
// Power-of-two scales make v s and q / s exact, so the cast is the only rounding. With
// `transpose` the output is the quantised x^T, contiguous [cols, rows], its groups the columns of
// x: the column-major operand at::_scaled_mm takes. A NaN or infinite value makes its whole group
// NaN, scale included (the step's numerics guard sees it). A factor per column (`x_scale` [1, cols]
// for a non-float8 x, rows per row only) multiplies v before the rows are quantised: the float8
// layer's backward folds its weight's row scales into the gradient with it (powers of two: exact).
//
// Schemas (namespace `d9d`, src/kernels/float8.cpp; CPU reference there, CUDA in
// kernels/float8.cu):
//   float8_quantize(Tensor x, Tensor? x_scale, ScalarType dtype, bool rowwise, bool transpose)
//       -> (Tensor, Tensor)
//   float8_quantize_both(Tensor x, ScalarType dtype, bool rowwise, Tensor? rows_factor)
//       -> (Tensor, Tensor, Tensor, Tensor)
//   float8_transpose(Tensor x) -> Tensor
// The second is the first without and with transpose in one call (what a GEMM's input and the
// weight gradient's take; the rows optionally of x times a factor per column). The third copies a
// float8 matrix's bytes transposed (contiguous [cols, rows]), no rounding.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace d9d::kernels {

/// A float8 tensor and the float32 scale that dequantises it: value = data * scale, with `scale`
/// [rows, 1] (one per row) or 0-dimensional (one for the tensor).
struct Float8Tensor {
  at::Tensor data;
  at::Tensor scale;
  [[nodiscard]] bool rowwise() const { return scale.dim() == 2; }
};

/// The largest finite value of a float8 format (448 for e4m3fn, 57344 for e5m2).
[[nodiscard]] float float8_max(at::ScalarType format);

/// Quantises the 2-D tensor x (float32, float64, bfloat16 or float16; or float8 with `x_scale`,
/// its dequantisation scale: [rows, 1] or 0-dimensional) to `format` (at::kFloat8_e4m3fn or
/// at::kFloat8_e5m2), one scale per output row (`rowwise`) or one for the tensor; with `transpose`
/// the output is x^T, contiguous. A non-float8 x may take a float32 factor per column as
/// `x_scale` ([1, cols]; rowwise, not transposed): x times it is quantised. No autograd.
[[nodiscard]] Float8Tensor float8_quantize(const at::Tensor& x, at::ScalarType format, bool rowwise,
                                           bool transpose = false,
                                           const at::Tensor& x_scale = at::Tensor());

/// float8_quantize(x, format, rowwise, false, rows_factor) and float8_quantize(x, format, rowwise,
/// true) — the rows (of x times `rows_factor` [1, cols] when given: rowwise only) and the columns
/// (x^T) — from one call, bit for bit the same. x as float8_quantize's, not float8.
[[nodiscard]] std::pair<Float8Tensor, Float8Tensor> float8_quantize_both(
    const at::Tensor& x, at::ScalarType format, bool rowwise,
    const at::Tensor& rows_factor = at::Tensor());

/// t's float8 matrix transposed: its bytes as a contiguous [cols, rows] matrix (on CUDA a tiled
/// copy), no rounding. With `unit_scales` (t per row) the scale becomes ones [cols, 1] (the value
/// is then the bytes alone: for a GEMM whose other operand took t's row scales); otherwise a
/// per-tensor t keeps its scale (a per-row t must take `unit_scales`).
[[nodiscard]] Float8Tensor float8_transpose(const Float8Tensor& t, bool unit_scales);

/// The dequantised value data * scale in `dtype` (float32 unless said).
[[nodiscard]] at::Tensor float8_dequantize(const Float8Tensor& t,
                                           at::ScalarType dtype = at::kFloat);

/// a b^T for a [M, K] and b [N, K] (both quantised along K: per row or per tensor, both alike),
/// as `out_dtype` [M, N]: on CUDA by at::_scaled_mm (float8 tensor cores, float32 accumulation;
/// `fast_accum`: Hopper's faster accumulation, for forward products), its output bfloat16 (then
/// cast) for per-row scales and for float64; on the CPU — and on CUDA for sizes at::_scaled_mm does
/// not take (K or N not a multiple of 16) — by the emulation: both dequantised in float32 (float64
/// for a float64 `out_dtype`) and multiplied there, which equals the exact product of the quantised
/// values up to the summation's rounding.
[[nodiscard]] at::Tensor float8_matmul(const Float8Tensor& a, const Float8Tensor& b,
                                       at::ScalarType out_dtype, bool fast_accum = false);

namespace detail {

/// Checks float8_quantize's arguments (std::invalid_argument-style TORCH_CHECK messages).
void check_float8_quantize(const at::Tensor& x, const at::Tensor& x_scale, at::ScalarType format,
                           bool rowwise, bool transpose);

/// Whether `x_scale` is a factor per column of a non-float8 x ([1, cols]).
[[nodiscard]] bool is_column_factor(const at::Tensor& x, const at::Tensor& x_scale);

/// The power-of-two scale s of a group whose largest magnitude is `amax` (see the file comment).
[[nodiscard]] float float8_scale(float amax, float format_max);

}  // namespace detail
}  // namespace d9d::kernels
