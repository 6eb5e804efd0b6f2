// d9d/pipeline/policies.hpp — pipeline policies: the schedule that runs the pp stages.
//
//   using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<4>>, d9d::pipeline::NoPipeline>;
//   static_assert(std::is_same_v<MyPlan::pipeline, d9d::pipeline::NoPipeline>);
//   static_assert(std::is_same_v<d9d::Plan<>::pipeline, MyPlan::pipeline>);  // the default
//
// Each models d9d::plan_policy for d9d::slot::pipeline. NoPipeline is the default; the schedules
// (GPipe, 1F1B, ZeroBubbleH1, ZeroBubbleV, DualPipeV, ...) are in d9d/pipeline/schedules.hpp and
// run through d9d/pipeline/executor.hpp.
#pragma once

#include <d9d/plan/defaults.hpp>  // NoPipeline, the default
