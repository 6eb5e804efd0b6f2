// Pipelines on pp = 2 and 4 Gloo ranks: every schedule, microbatches 1, 2, 4, 8 where the schedule
// allows, trainable and partly frozen weights; losses and every parameter gradient equal a
// single-process, non-pipelined reference, with point-to-point overlap (the default), without,
// and with pairs run at once (overlap_pairs); inference outputs equal the reference's logits.
// Compute does not wait for sends (a rank runs all its forwards before its peer posts a receive);
// every rank's measured timeline is gathered and drawn under the plan.
#include <chrono>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/pipeline/pairs.hpp>
#include <d9d/pipeline/picture.hpp>

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

// The same with each batch of sends and receives waited for before the next compute action (the
// model verify() checks; ExecutorOptions::overlap_p2p = false), trainable weights.
TEST_P(Pipeline_Gloo, WithoutOverlapEverySchedulesGradientsEqualTheReference) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = env.world_size()});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    std::map<int, d9d::testing::Reference> references;
    const int ran = d9d::testing::for_each_program(
        env.world_size(), {2, 4},
        [&](const std::string& what, const d9d::pipeline::Program& program) {
          const int m = program.microbatches;
          if (references.count(m) == 0) {
            references.emplace(m, d9d::testing::reference_step(m, false, ctx.device()));
          }
          const auto run = d9d::testing::pipeline_step(program, group, group.rank(), false,
                                                       ctx.device(), {}, {.overlap_p2p = false});
          d9d::testing::expect_matches(run, references.at(m), what + " without overlap");
        });
    EXPECT_GE(ran, 9);
  });
}

// ExecutorOptions::overlap_pairs: each rank runs a forward and the backward of its other stage at
// once where the regrouped program pairs them (DualPipeV's steady state, ZBV's), with its sends
// and receives around the pair; gradients and losses equal the single-process reference, for
// every schedule, trainable and frozen.
TEST_P(Pipeline_Gloo, OverlappedPairsGradientsEqualTheReference) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = env.world_size()});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    int paired = 0;
    for (const bool frozen : {false, true}) {
      std::map<int, d9d::testing::Reference> references;
      const int ran = d9d::testing::for_each_program(
          env.world_size(), {4, 8},
          [&](const std::string& what, const d9d::pipeline::Program& program) {
            const int m = program.microbatches;
            if (references.count(m) == 0) {
              references.emplace(m, d9d::testing::reference_step(m, frozen, ctx.device()));
            }
            const auto run = d9d::testing::pipeline_step(program, group, group.rank(), frozen,
                                                         ctx.device(), {}, {.overlap_pairs = true});
            d9d::testing::expect_matches(run, references.at(m),
                                         what + (frozen ? " frozen" : " trainable") + ", pairs");
            const auto grouped = d9d::pipeline::group_pairs(program);
            const auto& mine = grouped.ranks[static_cast<std::size_t>(group.rank())];
            for (std::size_t i = 0; i < mine.size(); ++i) {
              paired += d9d::pipeline::pair_at(mine, i) ? 1 : 0;
            }
          });
      EXPECT_GE(ran, 10);
    }
    EXPECT_GT(paired, 0) << "rank " << group.rank();
  });
}

// Rank 1 starts its step only once rank 0 has begun its last forward: rank 0's sends of the
// earlier activations cannot complete before then (a Gloo send completes once the receive is
// posted), so rank 0 gets there only because its compute does not wait for its sends. Without
// overlap rank 0 would wait for the first send, rank 1 for rank 0: the store wait below would
// time out. The step still equals the reference.
TEST(Pipeline_Gloo_pp2, ComputeDoesNotWaitForSends) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = 2});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    constexpr int kMicrobatches = 4;
    const auto program = d9d::pipeline::build_program<d9d::pipeline::GPipe<>>(2, kMicrobatches);
    const std::string key = "pipeline-test/rank0-last-forward";
    const auto run = d9d::testing::pipeline_step(
        program, group, group.rank(), false, ctx.device(), {}, {.record_timeline = true},
        [&](d9d::pipeline::Executor& executor) {
          if (group.rank() == 0) {
            executor.on_compute([&](const d9d::pipeline::Action& a, bool done) {
              if (!done && a.op == d9d::pipeline::Op::forward &&
                  a.microbatch == kMicrobatches - 1) {
                env.store().set(key, std::string("1"));
              }
            });
          } else {
            env.store().wait({key}, std::chrono::seconds(60));
          }
        });
    d9d::testing::expect_matches(run,
                                 d9d::testing::reference_step(kMicrobatches, false, ctx.device()),
                                 "GPipe pp=2 m=4, rank 1 late");
    // Rank 0 ran its four forwards (and sent them) before rank 1 received anything.
    d9d::testing::expect_timeline_of(run.timeline, program, group.rank(), "rank 1 late");
  });
}

// Every rank records when its compute actions ran; the gathered timeline has every rank's
// actions in its program's order, and the picture draws one rect per action per rank, planned
// (panel 0) and measured (panel 1).
TEST_P(Pipeline_Gloo, GatheredTimelineHasEveryRanksActionsAndIsDrawn) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const int pp = env.world_size();
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = pp});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    for (const auto& program :
         {d9d::pipeline::build_program<d9d::pipeline::OneFOneB<>>(pp, 4),
          d9d::pipeline::build_program<d9d::pipeline::ZeroBubbleV<>>(pp, 4)}) {
      const auto run = d9d::testing::pipeline_step(program, group, group.rank(), false,
                                                   ctx.device(), {}, {.record_timeline = true});
      d9d::testing::expect_timeline_of(run.timeline, program, group.rank(), "own");
      const auto gathered = d9d::pipeline::gather_timeline(group, run.timeline);
      ASSERT_EQ(gathered.ranks.size(), static_cast<std::size_t>(pp));
      for (int r = 0; r < pp; ++r) {
        d9d::testing::expect_timeline_of(gathered.ranks[static_cast<std::size_t>(r)], program, r,
                                         "gathered");
      }
      EXPECT_GT(gathered.makespan, 0.0);
      const auto svg = d9d::pipeline::planned_and_measured_svg(
          program, {{.title = "measured", .timeline = gathered}}, "test");
      for (int panel = 0; panel < 2; ++panel) {
        for (int r = 0; r < pp; ++r) {
          const auto actions = d9d::testing::compute_actions(program, r);
          EXPECT_EQ(
              d9d::testing::occurrences(svg, "data-panel=\"" + std::to_string(panel) +
                                                 "\" data-rank=\"" + std::to_string(r) + "\""),
              static_cast<int>(actions.size()))
              << "panel " << panel << " rank " << r;
          for (const auto& a : actions) {
            EXPECT_EQ(d9d::testing::occurrences(svg, "data-panel=\"" + std::to_string(panel) +
                                                         "\" data-rank=\"" + std::to_string(r) +
                                                         "\" data-action=\"" +
                                                         d9d::pipeline::to_string(a) + "\""),
                      1)
                << d9d::pipeline::to_string(a);
          }
        }
      }
      EXPECT_EQ(d9d::testing::occurrences(svg, "class=\"action\""),
                2 * static_cast<int>(program.microbatches * program.stages() *
                                     (program.split_backward ? 3 : 2)));
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
