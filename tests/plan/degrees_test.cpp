// Static facts of the degree types (compile-time checks run when this file compiles).
#include <gtest/gtest.h>

#include <d9d/plan/degrees.hpp>

namespace {

static_assert(d9d::tp<4>::value == 4 && !d9d::tp<4>::is_dynamic);
static_assert(d9d::dp_shard<d9d::dynamic>::is_dynamic);
static_assert(d9d::pp<1>::value == 1);
static_assert(d9d::ep<d9d::dynamic>::value == d9d::dynamic);

TEST(Plan_Degrees, StaticAndDynamicValues) {
  EXPECT_EQ(d9d::cp_shard<2>::value, 2);
  EXPECT_FALSE(d9d::cp_replicate<3>::is_dynamic);
  EXPECT_TRUE(d9d::dp_replicate<d9d::dynamic>::is_dynamic);
}

}  // namespace
