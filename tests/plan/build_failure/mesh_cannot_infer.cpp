// Build-failure test: a d9d::dynamic degree that cannot fill the declared world (8 / 3).
// expect-error: d9d::mesh: the product of the static degrees does not divide the declared
// expect-error: mesh_static_degrees_divide_world<3, 8>
// expect-error: Fix: choose static degrees whose product divides N
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<3>, d9d::world<8>>;

int main() { return Mesh::is_static ? 0 : 1; }
