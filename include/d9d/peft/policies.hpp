// d9d/peft/policies.hpp — parameter-efficient fine-tuning policies: which parameters train.
//
//   using MyPlan = d9d::Plan<d9d::peft::FullTune>;
//   static_assert(std::is_same_v<MyPlan::peft, d9d::peft::FullTune>);
//   static_assert(std::is_same_v<d9d::Plan<>::peft, d9d::peft::FullTune>);  // the default
//
// Each models d9d::plan_policy for d9d::slot::peft. LoRA and method stacks come with the PEFT
// component; FullTune is the default until then.
#pragma once

#include <d9d/plan/slots.hpp>

namespace d9d::peft {

/// Every parameter of the model trains. The default of the peft slot.
struct FullTune {
  using d9d_slot = slot::peft;
};

}  // namespace d9d::peft
