// Build-failure test: static_shape() of a mesh whose degrees are known only at start-up.
// expect-error: d9d::mesh::static_shape(): the mesh has d9d::dynamic degrees
// expect-error: Fix: call d9d::resolve_mesh<Mesh>(world_size, given) there
// The dynamic degree is spelled by name in the compiler's type names, not as -1:
// expect-error: d9d::dp_shard<d9d::dynamic>
// expect-no-error: dp_shard<-1>
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<2>>;

int main() { return Mesh::static_shape().tp; }
