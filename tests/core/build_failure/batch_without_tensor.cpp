// Build-failure test: a batch type in which split_batch finds no tensor (private members behind a
// constructor, not adapted) would otherwise be copied whole into every microbatch.
// expect-error: d9d::split_batch: the batch type holds no tensor the library can split
// expect-error: Fix: make the struct a plain aggregate (public members, no constructors
// expect-error: BOOST_HANA_ADAPT_STRUCT(MyBatch, member1, member2, ...)
#include <utility>

#include <d9d/core/batch_tree.hpp>

class Batch {
 public:
  explicit Batch(at::Tensor x) : x_(std::move(x)) {}

 private:
  at::Tensor x_;
};

void split(const Batch& batch) { (void)d9d::split_batch(batch, 4); }
