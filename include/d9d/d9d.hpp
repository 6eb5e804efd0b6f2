// d9d/d9d.hpp — everything a training program needs, in one include.
//
//   #include <d9d/d9d.hpp>
//   using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>>;
//   d9d::Trainer<MyPlan> trainer{ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{}, task, cfg};
//
// The plan and every policy, the trainer with its providers and config, the parallelize layer,
// the pipeline schedules, the models and the state I/O. Finer headers compile faster (LibTorch's
// frontend dominates either way); this one is for programs and examples.
#pragma once

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/parallel/policies.hpp>
#include <d9d/peft/policies.hpp>
#include <d9d/pipeline/policies.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/precision/policies.hpp>
#include <d9d/recompute/policies.hpp>
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/main.hpp>
#include <d9d/train/trainer.hpp>
