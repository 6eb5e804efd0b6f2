// Build-failure test: a policy inside d9d::mesh<...> (it belongs next to the mesh, in the Plan).
// expect-error: d9d::mesh: an argument is not a mesh degree or d9d::world<N>
// expect-error: plan_dependent_false<d9d::precision::Fp64>
// expect-error: policies go next to the mesh in d9d::Plan<...>
#include <d9d/plan/mesh.hpp>
#include <d9d/precision/policies.hpp>

using Mesh = d9d::mesh<d9d::dp_shard<4>, d9d::precision::Fp64>;

int main() { return Mesh::is_static ? 0 : 1; }
