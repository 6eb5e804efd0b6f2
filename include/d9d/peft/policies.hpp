// d9d/peft/policies.hpp — parameter-efficient fine-tuning policies: which parameters train.
//
//   using MyPlan = d9d::Plan<d9d::peft::FullTune>;
//   static_assert(std::is_same_v<MyPlan::peft, d9d::peft::FullTune>);
//   static_assert(std::is_same_v<d9d::Plan<>::peft, d9d::peft::FullTune>);  // the default
//
// Each models d9d::plan_policy for d9d::slot::peft. LoRA and method stacks come with the PEFT
// component; FullTune is the default until then.
#pragma once

#include <d9d/plan/defaults.hpp>  // FullTune, the default
