// Build-failure test: ep must divide the ranks of one pipeline stage (4 does not divide 3 * 2).
// expect-error: d9d::mesh: ep does not divide dp_replicate * dp_shard * cp_replicate * cp_shard
// expect-error: mesh_ep_divides_stage<4, 6>
// expect-error: Fix: choose ep among the divisors of that product
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::dp_shard<3>, d9d::tp<2>, d9d::ep<4>>;

int main() { return Mesh::is_static ? 0 : 1; }
