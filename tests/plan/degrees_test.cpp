// Static facts of the degree types and d9d::world (compile-time checks run when this file
// compiles).
#include <string>

#include <gtest/gtest.h>

#include <d9d/plan/degrees.hpp>

namespace {

static_assert(d9d::tp<4>::value == 4 && !d9d::tp<4>::is_dynamic);
static_assert(d9d::dp_shard<d9d::dynamic>::is_dynamic);
static_assert(d9d::pp<1>::value == 1);
static_assert(d9d::ep<d9d::dynamic>::value == d9d::dynamic);

// Which types are degrees: the seven degree templates, not d9d::world and not look-alikes.
struct LooksLikeADegree {
  static constexpr int dim = 5;
  static constexpr int value = 2;
};
static_assert(d9d::mesh_degree<d9d::pp<2>> && d9d::mesh_degree<d9d::ep<d9d::dynamic>>);
static_assert(!d9d::mesh_degree<d9d::world<8>> && !d9d::mesh_degree<int>);
static_assert(!d9d::mesh_degree<LooksLikeADegree>);

static_assert(d9d::world<8>::value == 8 && !d9d::world<8>::is_dynamic);
static_assert(d9d::world<d9d::dynamic>::is_dynamic);

TEST(Plan_Degrees, StaticAndDynamicValues) {
  EXPECT_EQ(d9d::cp_shard<2>::value, 2);
  EXPECT_FALSE(d9d::cp_replicate<3>::is_dynamic);
  EXPECT_TRUE(d9d::dp_replicate<d9d::dynamic>::is_dynamic);
}

TEST(Plan_Degrees, NamesAreConfigKeys) {
  EXPECT_EQ(std::string(d9d::pp<1>::name), "pp");
  EXPECT_EQ(std::string(d9d::dp_replicate<1>::name), "dp_replicate");
  EXPECT_EQ(std::string(d9d::dp_shard<1>::name), "dp_shard");
  EXPECT_EQ(std::string(d9d::cp_replicate<1>::name), "cp_replicate");
  EXPECT_EQ(std::string(d9d::cp_shard<1>::name), "cp_shard");
  EXPECT_EQ(std::string(d9d::tp<1>::name), "tp");
  EXPECT_EQ(std::string(d9d::ep<d9d::dynamic>::name), "ep");
}

}  // namespace
