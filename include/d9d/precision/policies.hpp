// d9d/precision/policies.hpp — precision policies: the dtypes of parameters, compute and gradient
// reduction.
//
//   using MyPlan = d9d::Plan<d9d::precision::Bf16Mixed>;
//   static_assert(MyPlan::precision::compute == d9d::precision::Dtype::bfloat16);
//   static_assert(std::is_same_v<d9d::Plan<>::precision, d9d::precision::Fp32>);  // the default
//   using Fast = d9d::Plan<d9d::precision::Bf16MixedBf16Reduce>;  // bf16 gradient reductions
//
// Each models d9d::plan_policy for d9d::slot::precision and states its facts as members:
// `parameters` (the dtype the optimizer updates), `compute` (the dtype of the forward's matrix
// products: the parameters' own, or bf16 under autocast) and `reduce` (the dtype gradients are
// reduced in). The training steps read those facts; nothing branches on the policy's name.
// Policies with bfloat16 parameters also state `stochastic_rounding` (how the optimizer rounds
// its updates) and `optimizer_state` (the dtype of AdamW's moments); the others keep the moments
// in the parameters' dtype.
//
//   using SrPlan = d9d::Plan<d9d::precision::Bf16Params<>>;   // stochastic rounding, fp32 moments
//   using Torch = d9d::Plan<d9d::precision::Bf16Params<d9d::precision::NearestRounding>>;
//
// Float8<Scaling, Gather, Base> runs the attention and MLP projections' GEMMs in float8 on top of
// a base policy, whose facts it keeps (docs/design/0022-float8-linear-layers.md):
//
//   using Fp8Plan = d9d::Plan<d9d::precision::Float8<>>;  // rowwise scales, over Bf16Mixed
//   using Fp8Fsdp = d9d::Plan<d9d::mesh<d9d::dp_shard<2>>, d9d::parallel::FullyShard<>,
//       d9d::precision::Float8<d9d::precision::Scaling::rowwise,
//                              d9d::precision::WeightGather::float8>>;  // weights gathered in FP8
#pragma once

#include <concepts>
#include <type_traits>

#include <d9d/plan/defaults.hpp>  // Dtype and Fp32, the default

namespace d9d::precision {

/// Mixed precision: float32 master parameters, bfloat16 compute (autocast), gradients reduced
/// over the data-parallel ranks in `Reduce`: float32 (Bf16Mixed), or bfloat16, which halves the
/// bytes of Replicate's all-reduce and FullyShard's reduce-scatter (FullyShard<R,
/// ReduceDtype::as_precision>) at one more rounding of each rank's gradient and of their sum
/// (tests/parallel/mixed_precision_multiprocess_test bounds both against float32).
template <Dtype Reduce = Dtype::float32>
struct Bf16Compute {
  static_assert(Reduce == Dtype::float32 || Reduce == Dtype::bfloat16,
                "d9d::precision::Bf16Compute<Reduce>: gradients are reduced in float32 or "
                "bfloat16. Fix: Bf16Compute<> (= Bf16Mixed) or Bf16Compute<Dtype::bfloat16>");
  using d9d_slot = slot::precision;
  static constexpr Dtype parameters = Dtype::float32;
  static constexpr Dtype compute = Dtype::bfloat16;
  static constexpr Dtype reduce = Reduce;
};

/// The usual mixed precision: float32 master parameters, bfloat16 compute, float32 reductions.
using Bf16Mixed = Bf16Compute<>;
/// Bf16Mixed with its gradient reductions in bfloat16 (half the data-parallel traffic).
using Bf16MixedBf16Reduce = Bf16Compute<Dtype::bfloat16>;

/// Parameters, compute and gradients in float64: a reference precision for numerical checks, not
/// for speed. A parallel run and a single-process run of the same plan differ only by the
/// summation order of their reductions; in float64 that is ~1e-16 relative, so their equality can
/// be tested tightly even after AdamW, whose normalised update magnifies the float32 rounding of
/// tiny gradients (tests/train: the multi-process equality tests).
struct Fp64 {
  using d9d_slot = slot::precision;
  static constexpr Dtype parameters = Dtype::float64;
  static constexpr Dtype compute = Dtype::float64;
  static constexpr Dtype reduce = Dtype::float64;
};

/// Rounding of bfloat16 parameter updates: up with probability equal to the dropped fraction, so
/// the expected parameter follows the float32 update (the seeds' SR-AdamW;
/// d9d/kernels/stochastic.hpp).
struct StochasticRounding {};
/// Rounding of bfloat16 parameter updates to nearest: what torch's AdamW does to bfloat16
/// parameters (updates below half a bfloat16 step are lost).
struct NearestRounding {};

namespace detail {
template <class Rounding>
inline constexpr Dtype default_optimizer_state =
    std::is_same_v<Rounding, StochasticRounding> ? Dtype::float32 : Dtype::bfloat16;
}  // namespace detail

/// bfloat16 parameters, gradients and compute, no float32 master copy: half the parameter and
/// gradient memory of Bf16Mixed and no per-step casts of the weights. The optimizer is
/// d9d::optim::StochasticAdamW (one launch, moments in `State`: float32 by default, or bfloat16)
/// under StochasticRounding, torch's fused AdamW with bfloat16 moments under NearestRounding.
/// Gradients are reduced in bfloat16.
template <class Rounding = StochasticRounding,
          Dtype State = detail::default_optimizer_state<Rounding>>
struct Bf16Params {
  static_assert(std::is_same_v<Rounding, StochasticRounding> ||
                    std::is_same_v<Rounding, NearestRounding>,
                "d9d::precision::Bf16Params: the rounding is d9d::precision::StochasticRounding "
                "or d9d::precision::NearestRounding");
  static_assert(State == Dtype::float32 || State == Dtype::bfloat16,
                "d9d::precision::Bf16Params: the optimizer state is float32 or bfloat16");
  static_assert(std::is_same_v<Rounding, StochasticRounding> || State == Dtype::bfloat16,
                "d9d::precision::Bf16Params: NearestRounding runs torch's fused AdamW, whose "
                "moments share the parameters' dtype. Fix: Bf16Params<NearestRounding> (bfloat16 "
                "moments), or StochasticRounding for float32 moments");
  using d9d_slot = slot::precision;
  static constexpr Dtype parameters = Dtype::bfloat16;
  static constexpr Dtype compute = Dtype::bfloat16;
  static constexpr Dtype reduce = Dtype::bfloat16;
  static constexpr bool stochastic_rounding = std::is_same_v<Rounding, StochasticRounding>;
  static constexpr Dtype optimizer_state = State;
};

/// How Float8 scales the tensors of a float8 GEMM.
enum class Scaling : unsigned char {
  /// One scale per row along the contracted dimension (per token of the activations and
  /// gradients, per output row of the weights); every operand in e4m3fn. torchao's "rowwise".
  rowwise,
  /// One scale per tensor; activations and weights in e4m3fn, gradients in e5m2 (more range,
  /// less precision). torchao's "tensorwise".
  tensorwise,
};

/// What FullyShard all-gathers for a float8 linear layer's weight.
enum class WeightGather : unsigned char {
  compute_dtype,  ///< the weight in the compute dtype (bfloat16), quantised after the gather
  /// the weight quantised on its owner rank, gathered as float8 with its float32 scales: half the
  /// bytes of bfloat16, and the same values (per row, a row's scale needs only that row; per
  /// tensor, the shards' largest magnitudes are all-reduced first, a few bytes per weight)
  float8,
};

namespace detail {
template <class P>
concept dtype_facts = requires {
  { P::parameters } -> std::convertible_to<Dtype>;
  { P::compute } -> std::convertible_to<Dtype>;
  { P::reduce } -> std::convertible_to<Dtype>;
};
}  // namespace detail

/// FP8 training: the GEMMs of the attention projections (q, k, v, o) and of the MLP (gate, up,
/// down) in float8 — forward, input gradient and weight gradient, each operand quantised with
/// power-of-two scales computed on the device (d9d/kernels/float8.hpp) — and everything else as
/// `Base` says: master parameters, optimizer, reductions, the embedding, norms, attention itself,
/// the head and the MoE routers and experts. On CUDA the GEMMs are at::_scaled_mm (sm_89 or newer:
/// H100, H200, Ada; a start-up error elsewhere); on the CPU an emulation computes the same
/// quantised values and multiplies them dequantised, so CI tests the logic. Under a split backward
/// (zero-bubble pipelines) the weight-gradient GEMM is queued in float8 too.
template <Scaling S = Scaling::rowwise, WeightGather G = WeightGather::compute_dtype,
          class Base = Bf16Mixed>
struct Float8 : Base {
  static_assert(detail::dtype_facts<Base>,
                "d9d::precision::Float8<S, G, Base>: Base is a precision policy stating "
                "`parameters`, `compute` and `reduce` (e.g. d9d::precision::Bf16Mixed)");
  static_assert(
      !requires { Base::float8_scaling; },
      "d9d::precision::Float8<S, G, Base>: Base is itself a Float8 policy. Fix: one "
      "Float8<...> over a plain policy (Bf16Mixed, Bf16Params<>, Fp32, Fp64)");
  using base = Base;
  static constexpr Scaling float8_scaling = S;
  static constexpr WeightGather float8_weight_gather = G;
};

/// Whether precision policy P runs float8 linear layers (a Float8<...>).
template <class P>
inline constexpr bool has_float8 = requires {
  P::float8_scaling;
};

}  // namespace d9d::precision
