"""d9d.cpp Bazel macros: warnings-as-errors for the project's code, tests, build-failure tests,
CUDA objects compiled by nvcc."""

load("@torch//:defs.bzl", "NVCC", "TORCH_DEFINES", "TORCH_INCLUDE_DIRS")

# Our own code builds with every common warning as an error; LibTorch and Debian headers come in as
# system headers (-isystem) and are not ours to fix.
# GCC's flow-sensitive warnings misfire on LibTorch/libstdc++ code inlined into ours when optimising
# (e.g. std::vector<bool> inside torch::autograd::Function::apply), so those three are off.
D9D_COPTS = [
    "-Wall",
    "-Wextra",
    "-Wpedantic",
    "-Werror",
    "-Wno-array-bounds",
    "-Wno-stringop-overflow",
    "-Wno-stringop-overread",
]

# The library itself (src/) is always optimised: its CPU kernels are what CPU runs execute.
D9D_LIB_COPTS = D9D_COPTS + ["-O2"]

def d9d_cc_test(name, srcs, deps = [], size = "small", tags = [], **kwargs):
    """A GoogleTest binary of the project (gtest_main, -Werror, LibTorch)."""
    native.cc_test(
        name = name,
        srcs = srcs,
        copts = D9D_COPTS,
        deps = deps + ["//:d9d", "@torch"],
        linkopts = ["-lgmock", "-lgtest", "-lgtest_main", "-pthread"],
        size = size,
        tags = tags,
        **kwargs
    )

def d9d_multiprocess_test(name, srcs, deps = [], size = "medium", tags = [], **kwargs):
    """A GoogleTest binary whose tests start rank processes (d9d/testing/multiprocess.hpp)."""
    d9d_cc_test(
        name = name,
        srcs = srcs,
        deps = deps + ["//:d9d_testing"],
        size = size,
        tags = tags + ["multiprocess"],
        **kwargs
    )

def d9d_build_failure_test(name, src, torch = False, size = "small", **kwargs):
    """Compiles `src`, which must FAIL to compile with every `// expect-error: <text>` line of it
    appearing in the compiler's output (tools/build-failure-check)."""
    flags = ["-std=c++20", "-Iinclude"] + ["-D" + d for d in TORCH_DEFINES]
    if torch:
        flags += ["-isystem" + d for d in TORCH_INCLUDE_DIRS]
    native.sh_test(
        name = name,
        srcs = ["//tools:build-failure-check"],
        args = ["$(CC)", "$(location %s)" % src] + flags,
        data = [src, "//:public_headers"],
        toolchains = ["@bazel_tools//tools/cpp:current_cc_toolchain"],
        size = size,
        tags = ["build_failure"],
        **kwargs
    )

# sm_90: H100 / H200. PTX for compute_90 is embedded too, so newer GPUs JIT it.
NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-Wall,-Wextra,-Werror",
    "-Werror=all-warnings",
    "--expt-relaxed-constexpr",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
    "-Iinclude",
] + ["-isystem " + d for d in TORCH_INCLUDE_DIRS] + ["-D" + d for d in TORCH_DEFINES]

def d9d_cuda_object(name, src, hdrs = []):
    """Compiles one .cu file with nvcc into `<name>.o` (no GPU needed). Emits nothing when the
    machine has no nvcc."""
    if not NVCC:
        return
    native.genrule(
        name = name,
        srcs = [src] + hdrs,
        outs = [name + ".o"],
        cmd = "%s %s -c $(location %s) -o $@" % (NVCC, " ".join(NVCC_FLAGS), src),
        message = "nvcc " + src,
    )

def has_nvcc():
    return bool(NVCC)
