// d9d/kernels/float8_sharded.hpp — per-tensor float8 quantisation of a tensor whose rows are split
// over ranks (FullyShard's tensorwise float8 weight gather): each rank takes the largest magnitude
// of its rows as float bits, the ranks' bits are reduced by an integer maximum (an all-reduce), and
// each rank casts its rows with the scale of that maximum. The result is, row for row,
// d9d::float8_quantize(whole, format, /*rowwise=*/false) of the whole tensor (its definition:
// d9d/kernels/float8.hpp).
//
//   auto bits = d9d::kernels::float8_amax_bits(my_rows);        // int32, 0-dimensional
//   bits = d9d::all_reduce(group, bits, d9d::ReduceOp::max);     // the whole tensor's
//   auto q = d9d::kernels::float8_quantize_with_amax(my_rows, bits, at::kFloat8_e4m3fn);
//
// Bits, not floats: non-negative floats order like their bit patterns read as integers, and every
// NaN with its sign cleared (what these kernels return for a tensor holding a NaN) lies above
// infinity (0x7F800000), so an integer maximum keeps the definition's rule that a NaN (or
// infinite) value makes the whole tensor NaN, whatever a reduction of floats does with NaN.
//
// Schemas (namespace `d9d`; CPU in src/kernels/float8.cpp, CUDA in kernels/float8.cu):
//   float8_amax_bits(Tensor x) -> Tensor
//   float8_quantize_with_amax(Tensor x, Tensor amax_bits, ScalarType dtype) -> (Tensor, Tensor)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <d9d/kernels/float8.hpp>

namespace d9d::kernels {

/// The largest magnitude of the 2-D tensor x (float32, float64, bfloat16 or float16; its values
/// read as float32, as float8_quantize reads them) as float bits: an int32 0-dimensional tensor
/// on x's device; 0 for an empty x, the bits of NaN when x holds a NaN.
[[nodiscard]] at::Tensor float8_amax_bits(const at::Tensor& x);

/// x (as float8_amax_bits takes it) quantised to `format` with one scale, that of the largest
/// magnitude `amax_bits` (float8_amax_bits' form, on x's device): equal to
/// float8_quantize(x, format, false) when `amax_bits` is x's own maximum. The scale is returned
/// for an empty x too (0-dimensional, float32).
[[nodiscard]] Float8Tensor float8_quantize_with_amax(const at::Tensor& x,
                                                     const at::Tensor& amax_bits,
                                                     at::ScalarType format);

namespace detail {

/// Checks float8_quantize_with_amax's arguments (and float8_amax_bits' x, with an undefined
/// amax_bits).
void check_float8_with_amax(const at::Tensor& x, const at::Tensor& amax_bits,
                            at::ScalarType format);

}  // namespace detail
}  // namespace d9d::kernels
