// Pipelines on pp = 2 and 4 Gloo ranks: every schedule, microbatches 1, 2, 4, 8 where the schedule
// allows, trainable and partly frozen weights; losses and every parameter gradient equal a
// single-process, non-pipelined reference; inference outputs equal the reference's logits.
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/pipeline_run/pipeline_fixture.hpp"

namespace {

using d9d::testing::RankEnv;

class Pipeline_Gloo : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(GetParam()); }
};

TEST_P(Pipeline_Gloo, EverySchedulesGradientsEqualTheReference) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = env.world_size()});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    for (const bool frozen : {false, true}) {
      std::map<int, d9d::testing::Reference> references;
      const int ran = d9d::testing::for_each_program(
          env.world_size(), {1, 2, 4, 8},
          [&](const std::string& what, const d9d::pipeline::Program& program) {
            const int m = program.microbatches;
            if (references.count(m) == 0) {
              references.emplace(m, d9d::testing::reference_step(m, frozen, ctx.device()));
            }
            const auto run =
                d9d::testing::pipeline_step(program, group, group.rank(), frozen, ctx.device());
            d9d::testing::expect_matches(run, references.at(m),
                                         what + (frozen ? " frozen" : " trainable"));
          });
      // 7 schedules x 4 microbatch counts, less those a schedule rejects: 1F1B needs m >= pp,
      // interleaving m % pp == 0, DualPipeV m >= 2 pp.
      EXPECT_EQ(ran, env.world_size() == 2 ? 4 + 4 + 3 + 3 + 4 + 4 + 2 : 4 + 4 + 2 + 2 + 4 + 4 + 1);
    }
  });
}

TEST_P(Pipeline_Gloo, InferenceOutputsEqualTheReference) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = env.world_size()});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    for (const int m : {1, 2, 4, 8}) {
      const auto program =
          d9d::pipeline::build_program<d9d::pipeline::Inference<>>(env.world_size(), m);
      const auto reference = d9d::testing::reference_step(m, false, ctx.device());
      const auto run =
          d9d::testing::pipeline_step(program, group, group.rank(), false, ctx.device());
      if (group.rank() != env.world_size() - 1) {
        EXPECT_TRUE(run.result.outputs.empty());
        EXPECT_TRUE(run.result.losses.empty());
        continue;
      }
      ASSERT_EQ(run.result.outputs.size(), static_cast<std::size_t>(m));
      for (int mb = 0; mb < m; ++mb) {
        const auto& got = run.result.outputs[static_cast<std::size_t>(mb)];
        EXPECT_FALSE(got.requires_grad());
        EXPECT_TRUE(at::allclose(got, reference.logits[static_cast<std::size_t>(mb)],
                                 d9d::testing::kRtol, d9d::testing::kAtol))
            << "m=" << m << " microbatch " << mb;
      }
      for (const auto& [name, grad] : run.grads) {
        EXPECT_FALSE(grad.defined()) << name << " got a gradient in inference";
      }
    }
  });
}

// Data parallel 2 x pipeline 2 on 4 ranks: each data-parallel replica pipelines half of the global
// batch; gradients summed over the replicas equal the single-process step over the whole batch.
TEST(Pipeline_Gloo_dp2_pp2, GradientsReducedOverReplicasEqualTheReference) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = 2, .dp_replicate = 2});
    const auto pp = mesh.group(d9d::MeshDomain::regular, "pp");
    const auto dp = mesh.group(d9d::MeshDomain::batch, "dp");
    ASSERT_EQ(pp.size(), 2);
    ASSERT_EQ(dp.size(), 2);
    for (const auto& schedule : {std::string("1F1B"), std::string("ZeroBubbleH1")}) {
      for (const int m : {2, 4}) {
        const auto program =
            schedule == "1F1B" ? d9d::pipeline::build_program<d9d::pipeline::OneFOneB<>>(2, m)
                               : d9d::pipeline::build_program<d9d::pipeline::ZeroBubbleH1<>>(2, m);
        // The global batch: 2 m microbatches; replica d takes rows of microbatches [d m, d m + m).
        const auto all = d9d::testing::step_tokens(2 * m);
        const int64_t rows = m * d9d::testing::kMicrobatchSize;
        const d9d::testing::StepData data{
            .tokens = all.narrow(0, dp.rank() * rows, rows).contiguous(),
            .total_tokens = static_cast<double>(2 * rows * d9d::testing::kSeq)};
        auto run = d9d::testing::pipeline_step(program, pp, pp.rank(), false, ctx.device(), data);
        for (auto& [name, grad] : run.grads) {
          grad = d9d::all_reduce(dp, grad.to(ctx.device())).cpu();
        }
        run.result.losses.clear();  // each replica's losses cover half of the batch
        const auto reference = d9d::testing::reference_step(2 * m, false, ctx.device());
        d9d::testing::expect_matches(run, reference,
                                     schedule + " dp=2 pp=2 m=" + std::to_string(m));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Pipeline_Gloo, ::testing::Values(2, 4),
                         [](const auto& info) { return "pp" + std::to_string(info.param); });

}  // namespace
