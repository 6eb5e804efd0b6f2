// d9d/parallel/peft.cpp — the peft policies' component in the parallelize layer (apply_peft).
#include <ATen/ATen.h>

#include <d9d/core/collectives.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/peft/lora.hpp>

namespace d9d::parallel::detail {

void apply_peft(ParallelModel& model, const peft::StackSpec& spec) {
  const auto& mesh = model.mesh();
  peft::detail::apply_stack(
      model.modules(), spec, model.options().seed, [&mesh](std::vector<int64_t>& counts) {
        // Pipeline ranks hold different stages: a pattern counts when it matches on any of them.
        if (mesh.size(MeshDomain::regular, "pp") <= 1) {
          return;
        }
        const auto device = mesh.context().device();
        const auto summed =
            all_reduce(mesh.group(MeshDomain::regular, "pp"),
                       at::tensor(counts, at::TensorOptions().dtype(at::kLong)).to(device))
                .cpu();
        for (std::size_t i = 0; i < counts.size(); ++i) {
          counts[i] = summed[static_cast<int64_t>(i)].item<int64_t>();
        }
      });
  rerecord_parameters(model);
}

}  // namespace d9d::parallel::detail
