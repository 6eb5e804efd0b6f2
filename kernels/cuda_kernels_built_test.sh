#!/usr/bin/env bash
# The CUDA kernels were compiled for Hopper (sm_90) and carry their TORCH_LIBRARY_IMPL entry points.
# Runs without a GPU (and without cuobjdump): it inspects the shared library with binutils.
set -euo pipefail
lib=$1  # the shared library with the CUDA kernels, or --no-nvcc
fail() { echo "FAIL: $*"; exit 1; }
[ "$lib" != --no-nvcc ] || fail "no nvcc was found when Bazel configured @torch (PATH, \
/usr/local/cuda/bin), so the CUDA kernels were not compiled. Install the CUDA Toolkit 13 (nvcc) and \
run 'bazel clean' (or 'bazel sync --configure'), or leave this check out: D9D_NO_CUDA=1 tools/test"
# (Outputs are captured before grep -q: with pipefail, grep -q closing a pipe early fails it.)
sections=$(readelf -S "$lib")
grep -q '\.nv_fatbin' <<<"$sections" || fail "$lib has no .nv_fatbin section (no device code)"
fatbin=$(mktemp)
trap 'rm -f "$fatbin"' EXIT
objcopy -O binary --only-section=.nv_fatbin "$lib" "$fatbin"
grep -q -- '-arch sm_90' <<<"$(strings "$fatbin")" || fail "no sm_90 device code in the fat binary"
symbols=$(nm -C "$lib")
for kernel in rms_norm_forward_kernel rms_norm_backward_kernel rope_kernel \
  silu_mul_forward_kernel silu_mul_backward_kernel; do
  for dtype in float double c10::BFloat16 c10::Half; do
    grep -q "${kernel}<${dtype}," <<<"$symbols" || fail "$kernel<$dtype> missing"
  done
done
for kernel in token_sum_kernel gather_rows_kernel unpermute_backward_kernel; do
  for dtype in float double c10::BFloat16 c10::Half; do
    grep -q "${kernel}<${dtype}," <<<"$symbols" || fail "$kernel<$dtype> missing"
  done
done
for kernel in adamw_stochastic_kernel copy_stochastic_kernel cross_entropy_rows_kernel \
  route_histogram_kernel route_scan_kernel route_place_kernel; do
  grep -q "$kernel" <<<"$symbols" || fail "$kernel missing"
done
for entry in moe_route_indices_cuda moe_permute_forward_cuda moe_permute_backward_cuda \
  moe_unpermute_forward_cuda moe_unpermute_backward_cuda cross_entropy_rows_cuda adamw_stochastic_cuda copy_stochastic_cuda rms_norm_forward_cuda rms_norm_backward_cuda rope_forward_cuda silu_mul_forward_cuda \
  silu_mul_backward_cuda; do
  grep -q "$entry" <<<"$symbols" || fail "host entry point $entry missing"
done
grep -q "CudaMicrobatchGraph::capture" <<<"$symbols" || fail "the CUDA-graph capture is missing"
echo "ok: sm_90 device code and the RMSNorm, RoPE, SiLU-mul and MoE permute kernels for 4 dtypes, the MoE routing, stochastic-rounding and cross-entropy ones and the CUDA-graph capture are in $lib"
