// d9d::mesh<...> (d9d/plan/mesh.hpp): static facts checked when this file compiles, and
// d9d::resolve_mesh at start-up with every run-time error it raises.
#include <stdexcept>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/plan/mesh.hpp>

namespace {

using ::testing::HasSubstr;

// A static mesh: every degree is a number, missing ones are 1, the world is their product.
using Dp4Tp2 = d9d::mesh<d9d::dp_shard<4>, d9d::tp<2>>;
static_assert(Dp4Tp2::dp_shard::value == 4 && Dp4Tp2::tp::value == 2);
static_assert(Dp4Tp2::pp::value == 1 && Dp4Tp2::ep::value == 1);
static_assert(Dp4Tp2::is_static && Dp4Tp2::world::value == 8);
static_assert(Dp4Tp2::static_shape() == d9d::MeshShape{.dp_shard = 4, .tp = 2});

// Order-free: the same degrees in another order (and with the world written out) agree.
using Tp2Dp4World8 = d9d::mesh<d9d::world<8>, d9d::tp<2>, d9d::dp_shard<4>>;
static_assert(Tp2Dp4World8::static_shape() == Dp4Tp2::static_shape());

// The empty mesh: one rank, nothing parallel.
static_assert(d9d::mesh<>::static_shape() == d9d::MeshShape{} && d9d::mesh<>::world::value == 1);

// One d9d::dynamic degree next to a static world is inferred by the compiler: 8 / 2 = 4.
using DpDynamicTp2World8 = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<2>, d9d::world<8>>;
static_assert(DpDynamicTp2World8::dp_shard::value == 4 && DpDynamicTp2World8::is_static);

// Without a static world a d9d::dynamic degree stays dynamic until d9d::resolve_mesh.
using DpDynamicTp2 = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<2>>;
static_assert(DpDynamicTp2::dp_shard::is_dynamic && !DpDynamicTp2::is_static);
static_assert(DpDynamicTp2::world::is_dynamic && DpDynamicTp2::tp::value == 2);

// Two dynamic degrees and a static world: the world is known, the degrees are not.
using DpDynamicTpDynamicWorld8 =
    d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>, d9d::world<8>>;
static_assert(!DpDynamicTpDynamicWorld8::is_static && DpDynamicTpDynamicWorld8::world::value == 8);

// ep does not multiply into the world, so a dynamic ep is never inferred at compile time.
using Dp4EpDynamic = d9d::mesh<d9d::dp_shard<4>, d9d::ep<d9d::dynamic>>;
static_assert(!Dp4EpDynamic::is_static && Dp4EpDynamic::world::value == 4);

using DpDynamicTpDynamic = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
using PpDynamicDpDynamicTp4 =
    d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>, d9d::tp<4>>;

// The message d9d::resolve_mesh throws, or "(no error)".
template <class Mesh>
std::string error_of(int world_size, const d9d::DynamicDegrees& given = {}) {
  try {
    (void)d9d::resolve_mesh<Mesh>(world_size, given);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(Plan_Mesh_dp4_tp2, ResolvesStaticShape) {
  EXPECT_EQ(d9d::resolve_mesh<Dp4Tp2>(8), (d9d::MeshShape{.dp_shard = 4, .tp = 2}));
  EXPECT_EQ(d9d::resolve_mesh<Tp2Dp4World8>(8), d9d::resolve_mesh<Dp4Tp2>(8));
}

TEST(Plan_Mesh_dp4_tp2, AcceptsConfigThatAgrees) {
  EXPECT_EQ(d9d::resolve_mesh<Dp4Tp2>(8, {.dp_shard = 4, .tp = 2}),
            (d9d::MeshShape{.dp_shard = 4, .tp = 2}));
}

TEST(Plan_Mesh_dp4_tp2, RejectsConfigThatContradicts) {
  EXPECT_EQ(error_of<Dp4Tp2>(8, {.tp = 4}),
            "d9d::mesh: tp = 4 in the config contradicts the plan's mesh, which fixes tp = 2 at "
            "compile time. Fix: remove tp from the config, or declare d9d::tp<d9d::dynamic> in the "
            "mesh to take it from the config");
}

TEST(Plan_Mesh_dp4_tp2, RejectsOtherWorldSize) {
  // MeshShape::check's rule, reached through resolve_mesh.
  EXPECT_THAT(error_of<Dp4Tp2>(6), HasSubstr("= 8 ranks, but the world has 6"));
}

TEST(Plan_Mesh_dp4_tp2, RejectsEmptyWorld) {
  EXPECT_THAT(error_of<Dp4Tp2>(0),
              HasSubstr("d9d::mesh: world size = 0, but a job has at least one rank. Fix:"));
}

TEST(Plan_Mesh_dpDynamic_tp2, InfersDpShardFromWorldSize) {
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTp2>(8), (d9d::MeshShape{.dp_shard = 4, .tp = 2}));
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTp2>(2), (d9d::MeshShape{.dp_shard = 1, .tp = 2}));
}

TEST(Plan_Mesh_dpDynamic_tp2, TakesDpShardFromConfig) {
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTp2>(4, {.dp_shard = 2}),
            (d9d::MeshShape{.dp_shard = 2, .tp = 2}));
  // Given, but not what the world needs: the message names the config key and the value that fits.
  EXPECT_EQ(error_of<DpDynamicTp2>(8, {.dp_shard = 2}),
            "d9d::mesh: pp * dp_replicate * dp_shard * cp_replicate * cp_shard * tp = "
            "(pp=1 dp_replicate=1 dp_shard=2 cp_replicate=1 cp_shard=1 tp=2 ep=1) = 4 ranks, but "
            "the world has 8; the config sets \"mesh.dp_shard\" = 2. Fix: set \"mesh.dp_shard\" to "
            "4, or remove it from the config to infer it from the world size, or launch 4 ranks");
  // No value fits (7 ranks): only removing the key or launching 4 ranks.
  EXPECT_THAT(error_of<DpDynamicTp2>(7, {.dp_shard = 2}),
              HasSubstr("Fix: remove \"mesh.dp_shard\" from the config to infer it from the world "
                        "size, or launch 4 ranks"));
}

TEST(Plan_Mesh_dpReplicateDynamic, ConfigDegreeThatDoesNotFitNamesTheKeyNotDynamic) {
  using DpReplicateDynamic = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;
  const auto message = error_of<DpReplicateDynamic>(2, {.dp_replicate = 4});
  EXPECT_THAT(message, HasSubstr("the config sets \"mesh.dp_replicate\" = 4. Fix: set "
                                 "\"mesh.dp_replicate\" to 2"));
  EXPECT_THAT(message, ::testing::Not(HasSubstr("make one degree d9d::dynamic")));
}

TEST(Plan_Mesh_dpDynamic_tpDynamic, TwoConfigDegreesThatDoNotFitNameBothKeys) {
  EXPECT_THAT(error_of<DpDynamicTpDynamic>(8, {.dp_shard = 2, .tp = 2}),
              HasSubstr("the config sets \"mesh.dp_shard\" = 2, \"mesh.tp\" = 2. Fix: set them "
                        "so that the product is 8, or remove one of them from the config"));
}

TEST(Plan_Mesh_dpDynamic_tp2, RejectsWorldItCannotDivide) {
  EXPECT_EQ(error_of<DpDynamicTp2>(7),
            "d9d::mesh: cannot infer dp_shard from the world size: the job has 7 ranks, which is "
            "not a multiple of pp * dp_replicate * cp_replicate * cp_shard * tp = 2. Fix: launch a "
            "multiple of that many ranks, or set the degrees in the config so that they divide 7");
}

TEST(Plan_Mesh_dpDynamic_tp2, RejectsDegreeBelowOne) {
  EXPECT_EQ(error_of<DpDynamicTp2>(8, {.dp_shard = 0}),
            "d9d::mesh: dp_shard = 0 is not a degree; every degree must be >= 1 (1 = not parallel "
            "along it). Fix: set dp_shard >= 1 in the config, or leave it out to infer it from the "
            "world size (when it is the only one left out)");
}

TEST(Plan_Mesh_dpDynamic_tpDynamic, InfersTheOneLeftOut) {
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTpDynamic>(8, {.tp = 2}),
            (d9d::MeshShape{.dp_shard = 4, .tp = 2}));
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTpDynamic>(8, {.dp_shard = 8}),
            (d9d::MeshShape{.dp_shard = 8, .tp = 1}));
}

TEST(Plan_Mesh_dpDynamic_tpDynamic, RejectsTwoLeftOut) {
  EXPECT_EQ(error_of<DpDynamicTpDynamic>(8),
            "d9d::mesh: dp_shard, tp are d9d::dynamic and not in the config; only one degree can "
            "be inferred from the world size. Fix: set all but one of dp_shard, tp in the config");
}

TEST(Plan_Mesh_ppDynamic_dpDynamic_tp4, RejectsProductBeyondWorld) {
  // The other degrees' product is reported as "more than" once it passes the world size, so a
  // huge config value cannot overflow it.
  EXPECT_THAT(error_of<PpDynamicDpDynamicTp4>(8, {.pp = 1'000'000'000}),
              HasSubstr("cannot infer dp_shard from the world size: the job has 8 ranks, which is "
                        "not a multiple of pp * dp_replicate * cp_replicate * cp_shard * tp = "
                        "more than 8"));
}

TEST(Plan_Mesh_dpDynamic_tp2_world8, RejectsOtherWorldSize) {
  EXPECT_EQ(error_of<DpDynamicTp2World8>(4),
            "d9d::mesh: the plan's mesh declares d9d::world<8>, but the job has 4 ranks. Fix: "
            "launch 8 ranks, or declare d9d::world<4> (or d9d::world<d9d::dynamic>) in the mesh");
}

TEST(Plan_Mesh_dpDynamic_tp2_world8, InferredDegreeIsFixed) {
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTp2World8>(8, {.dp_shard = 4}),
            (d9d::MeshShape{.dp_shard = 4, .tp = 2}));
  EXPECT_THAT(error_of<DpDynamicTp2World8>(8, {.dp_shard = 2}),
              HasSubstr("dp_shard = 2 in the config contradicts the plan's mesh, which fixes "
                        "dp_shard = 4 at compile time"));
}

TEST(Plan_Mesh_dpDynamic_tpDynamic_world8, ResolvesFromConfig) {
  EXPECT_EQ(d9d::resolve_mesh<DpDynamicTpDynamicWorld8>(8, {.dp_shard = 2}),
            (d9d::MeshShape{.dp_shard = 2, .tp = 4}));
}

TEST(Plan_Mesh_dp4_epDynamic, TakesEpFromConfig) {
  EXPECT_EQ(d9d::resolve_mesh<Dp4EpDynamic>(4, {.ep = 2}),
            (d9d::MeshShape{.dp_shard = 4, .ep = 2}));
}

TEST(Plan_Mesh_dp4_epDynamic, RejectsEpLeftOut) {
  EXPECT_EQ(error_of<Dp4EpDynamic>(4),
            "d9d::mesh: ep is d9d::dynamic and not in the config; it cannot be inferred from the "
            "world size, which it does not multiply into. Fix: set ep in the config to a divisor "
            "of dp_replicate * dp_shard * cp_replicate * cp_shard * tp");
}

TEST(Plan_Mesh_dp4_epDynamic, RejectsEpThatDoesNotDivide) {
  // MeshShape::check's ep rule, reached through resolve_mesh.
  EXPECT_THAT(error_of<Dp4EpDynamic>(4, {.ep = 3}), HasSubstr("ep = 3 must divide"));
}

TEST(Plan_Mesh_dpDynamic_tp2, SameInputsSameResultOnEveryRank) {
  // resolve_mesh communicates nothing: each rank computes the same shape, or the same error.
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(d9d::resolve_mesh<DpDynamicTp2>(8), d9d::resolve_mesh<DpDynamicTp2>(8));
    EXPECT_EQ(error_of<DpDynamicTp2>(7), error_of<DpDynamicTp2>(7));
  }
}

}  // namespace
