// d9d::Plan<Ps...> (d9d/plan/plan.hpp): slots, defaults, order-freedom, plan_with_t and the
// plan_policy opt-in. Most checks are static_asserts that run when this file compiles; the TESTs
// check the same facts at run time and resolve a plan's mesh.
#include <type_traits>

#include <gtest/gtest.h>

#include <d9d/parallel/policies.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/precision/policies.hpp>
#include <d9d/recompute/policies.hpp>

namespace {

// Every slot left empty gets its default.
using Defaults = d9d::Plan<>;
static_assert(std::is_same_v<Defaults::mesh, d9d::mesh<>>);
static_assert(std::is_same_v<Defaults::data_parallel, d9d::parallel::Replicate>);
static_assert(std::is_same_v<Defaults::pipeline, d9d::pipeline::NoPipeline>);
static_assert(std::is_same_v<Defaults::peft, d9d::peft::FullTune>);
static_assert(std::is_same_v<Defaults::precision, d9d::precision::Fp32>);
static_assert(std::is_same_v<Defaults::tensor_parallel, d9d::parallel::NoTensorParallel>);
static_assert(std::is_same_v<Defaults::expert_parallel, d9d::parallel::NoExpertParallel>);
static_assert(std::is_same_v<Defaults::context_parallel, d9d::parallel::NoContextParallel>);
static_assert(std::is_same_v<Defaults::activation_checkpointing, d9d::recompute::None>);

// Each policy fills its slot, in any order; the others keep their defaults.
using Dp4Tp2 = d9d::mesh<d9d::dp_shard<4>, d9d::tp<2>>;
using MyPlan = d9d::Plan<d9d::precision::Bf16Mixed, Dp4Tp2, d9d::parallel::Fsdp>;
static_assert(std::is_same_v<MyPlan::mesh, Dp4Tp2>);
static_assert(std::is_same_v<MyPlan::data_parallel, d9d::parallel::Fsdp>);
static_assert(std::is_same_v<MyPlan::precision, d9d::precision::Bf16Mixed>);
static_assert(std::is_same_v<MyPlan::pipeline, d9d::pipeline::NoPipeline>);
static_assert(MyPlan::mesh::static_shape() == d9d::MeshShape{.dp_shard = 4, .tp = 2});

// The same policies in another order resolve alike and have the same canonical form: every slot
// written out in slot order (mesh, data_parallel, tensor_parallel, expert_parallel,
// context_parallel, pipeline, peft, precision, activation_checkpointing).
using SamePlan = d9d::Plan<d9d::parallel::Fsdp, Dp4Tp2, d9d::precision::Bf16Mixed>;
static_assert(std::is_same_v<SamePlan::canonical, MyPlan::canonical>);
static_assert(
    std::is_same_v<MyPlan::canonical,
                   d9d::Plan<Dp4Tp2, d9d::parallel::Fsdp, d9d::parallel::NoTensorParallel,
                             d9d::parallel::NoExpertParallel, d9d::parallel::NoContextParallel,
                             d9d::pipeline::NoPipeline, d9d::peft::FullTune,
                             d9d::precision::Bf16Mixed, d9d::recompute::None>>);
// A recompute policy fills its own slot.
static_assert(d9d::Plan<d9d::recompute::EveryNth<3>>::activation_checkpointing::every_nth == 3);
static_assert(std::is_same_v<MyPlan::canonical::canonical, MyPlan::canonical>);

// plan_with_t swaps the slot the new policy fills and keeps the others.
using Replicated = d9d::plan_with_t<MyPlan, d9d::parallel::Replicate>;
static_assert(std::is_same_v<Replicated::data_parallel, d9d::parallel::Replicate>);
static_assert(std::is_same_v<Replicated::mesh, MyPlan::mesh>);
static_assert(std::is_same_v<Replicated::precision, MyPlan::precision>);
using Wider = d9d::plan_with_t<MyPlan, d9d::mesh<d9d::dp_shard<8>, d9d::tp<2>>>;
static_assert(Wider::mesh::world::value == 16);
static_assert(std::is_same_v<Wider::data_parallel, d9d::parallel::Fsdp>);
// Its result is canonical, so swapping a slot back gives the canonical original.
static_assert(std::is_same_v<d9d::plan_with_t<Replicated, d9d::parallel::Fsdp>, MyPlan::canonical>);

// A policy of one's own: opt in by naming the slot.
struct MySchedule {
  using d9d_slot = d9d::slot::pipeline;
};
static_assert(d9d::plan_policy<MySchedule>);
static_assert(std::is_same_v<d9d::Plan<MySchedule>::pipeline, MySchedule>);
static_assert(std::is_same_v<d9d::plan_with_t<d9d::Plan<MySchedule>, d9d::pipeline::NoPipeline>,
                             Defaults::canonical>);

// What is not a policy: no opt-in tag, a tag that names no slot, a bare mesh degree.
struct NamesNoSlot {
  using d9d_slot = int;
};
static_assert(!d9d::plan_policy<int> && !d9d::plan_policy<NamesNoSlot>);
static_assert(d9d::declares_plan_slot<NamesNoSlot> && !d9d::plan_slot<int>);
static_assert(!d9d::plan_policy<d9d::tp<2>> && !d9d::plan_policy<d9d::world<8>>);
static_assert(d9d::plan_slot<d9d::slot::precision> && d9d::plan_policy<d9d::mesh<d9d::tp<2>>>);
static_assert(d9d::plan_policy<d9d::parallel::Replicate> && d9d::plan_policy<d9d::peft::FullTune>);

TEST(Plan_Defaults, FillEverySlot) {
  EXPECT_TRUE((std::is_same_v<Defaults::mesh, d9d::mesh<>>));
  EXPECT_TRUE((std::is_same_v<Defaults::data_parallel, d9d::parallel::Replicate>));
  EXPECT_TRUE((std::is_same_v<Defaults::pipeline, d9d::pipeline::NoPipeline>));
  EXPECT_TRUE((std::is_same_v<Defaults::peft, d9d::peft::FullTune>));
  EXPECT_TRUE((std::is_same_v<Defaults::precision, d9d::precision::Fp32>));
  EXPECT_EQ(d9d::resolve_mesh<Defaults::mesh>(1), d9d::MeshShape{});
}

TEST(Plan_Mesh_dp4_tp2_Fsdp_Bf16Mixed, IsOrderFree) {
  EXPECT_TRUE((std::is_same_v<SamePlan::canonical, MyPlan::canonical>));
  EXPECT_TRUE((std::is_same_v<SamePlan::data_parallel, MyPlan::data_parallel>));
  EXPECT_TRUE((std::is_same_v<SamePlan::precision, d9d::precision::Bf16Mixed>));
}

TEST(Plan_Mesh_dp4_tp2_Fsdp_Bf16Mixed, ResolvesItsMesh) {
  EXPECT_EQ(d9d::resolve_mesh<MyPlan::mesh>(8), (d9d::MeshShape{.dp_shard = 4, .tp = 2}));
}

TEST(Plan_Mesh_dp4_tp2_Fsdp_Bf16Mixed, PlanWithSwapsOneSlot) {
  EXPECT_TRUE((std::is_same_v<Replicated::data_parallel, d9d::parallel::Replicate>));
  EXPECT_TRUE((std::is_same_v<Replicated::precision, d9d::precision::Bf16Mixed>));
  EXPECT_EQ(d9d::resolve_mesh<Wider::mesh>(16), (d9d::MeshShape{.dp_shard = 8, .tp = 2}));
}

TEST(Plan_MySchedule, UserPolicyFillsItsSlot) {
  EXPECT_TRUE(d9d::plan_policy<MySchedule>);
  EXPECT_TRUE((std::is_same_v<d9d::Plan<MySchedule>::pipeline, MySchedule>));
  EXPECT_FALSE(d9d::plan_policy<NamesNoSlot>);
}

}  // namespace
