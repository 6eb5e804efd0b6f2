// Build-failure test: static degrees that do not multiply to the declared world (4 * 4 != 8).
// expect-error: d9d::mesh: the degrees do not multiply to the declared d9d::world<N>
// expect-error: mesh_degrees_multiply_to_world<16, 8>
// expect-error: Fix: choose degrees whose product is N, or make one degree d9d::dynamic
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::dp_shard<4>, d9d::tp<4>, d9d::world<8>>;

int main() { return Mesh::is_static ? 0 : 1; }
