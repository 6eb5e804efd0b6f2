// d9d/kernels/cross_entropy.cpp — schema of d9d::cross_entropy_rows_ and its CPU reference kernel.
#include <cmath>
#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <d9d/kernels/cross_entropy.hpp>

namespace d9d::kernels {
namespace detail {

void check_cross_entropy_rows(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2, "d9d::cross_entropy_rows_: logits [n, V] expected, got ",
              logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()),
              "d9d::cross_entropy_rows_: logits must be floating point, got ",
              logits.scalar_type());
  TORCH_CHECK(logits.is_contiguous(), "d9d::cross_entropy_rows_: logits must be contiguous");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0),
              "d9d::cross_entropy_rows_: labels [", logits.size(0), "] expected, got ",
              labels.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong,
              "d9d::cross_entropy_rows_: labels must be int64, got ", labels.scalar_type());
  TORCH_CHECK(labels.device() == logits.device(), "d9d::cross_entropy_rows_: labels are on ",
              labels.device(), ", logits on ", logits.device());
}

}  // namespace detail

namespace {

at::Tensor cross_entropy_rows_cpu(const at::Tensor& logits, const at::Tensor& labels_arg,
                                  int64_t ignore_index) {
  detail::check_cross_entropy_rows(logits, labels_arg);
  const at::Tensor labels = labels_arg.contiguous();
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const auto acc_type = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor loss = at::empty({rows}, logits.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "d9d::cross_entropy_rows_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        scalar_t* data = logits.mutable_data_ptr<scalar_t>();
        const int64_t* label = labels.const_data_ptr<int64_t>();
        acc_t* out = loss.mutable_data_ptr<acc_t>();
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            scalar_t* row = data + r * vocab;
            const int64_t target = label[r];
            if (target == ignore_index) {
              for (int64_t i = 0; i < vocab; ++i) {
                row[i] = scalar_t(0);
              }
              out[r] = acc_t(0);
              continue;
            }
            TORCH_CHECK(target >= 0 && target < vocab, "d9d::cross_entropy_rows_: label ", target,
                        " of row ", r, " is outside [0, ", vocab, ")");
            acc_t max = -std::numeric_limits<acc_t>::infinity();
            for (int64_t i = 0; i < vocab; ++i) {
              max = std::max(max, static_cast<acc_t>(row[i]));
            }
            // The reference sums in double: its log-sum-exp is exact to the exp's rounding, so
            // the CUDA kernel's tree-reduced float sum is compared against the true value.
            double sum = 0;
            for (int64_t i = 0; i < vocab; ++i) {
              sum += std::exp(static_cast<double>(static_cast<acc_t>(row[i]) - max));
            }
            const auto lse = static_cast<acc_t>(static_cast<double>(max) + std::log(sum));
            out[r] = lse - static_cast<acc_t>(row[target]);
            for (int64_t i = 0; i < vocab; ++i) {
              const acc_t p = std::exp(static_cast<acc_t>(row[i]) - lse);
              row[i] = static_cast<scalar_t>(i == target ? p - acc_t(1) : p);
            }
          }
        });
      });
  return loss;
}

}  // namespace

at::Tensor cross_entropy_rows_(const at::Tensor& logits, const at::Tensor& labels,
                               int64_t ignore_index) {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("d9d::cross_entropy_rows_", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return handle.call(logits, labels, ignore_index);
}

}  // namespace d9d::kernels

TORCH_LIBRARY_FRAGMENT(d9d, m) {
  m.def("cross_entropy_rows_(Tensor(a!) logits, Tensor labels, int ignore_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(d9d, CPU, m) {
  m.impl("cross_entropy_rows_", &d9d::kernels::cross_entropy_rows_cpu);
}
