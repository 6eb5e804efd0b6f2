// Build-failure test: d9d::resolve_mesh takes the plan's mesh, not the plan.
// expect-error: d9d::resolve_mesh<Mesh>: Mesh must be a d9d::mesh<...>
// expect-error: Fix: pass the plan's mesh, d9d::resolve_mesh<MyPlan::mesh>(world_size, given)
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>>;

int main() { return d9d::resolve_mesh<MyPlan>(8).dp_shard; }
