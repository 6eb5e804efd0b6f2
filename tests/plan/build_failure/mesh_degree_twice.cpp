// Build-failure test: the same degree twice in one mesh.
// expect-error: d9d::mesh: d9d::tp is given more than once. Fix: give it once
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::tp<2>, d9d::dp_shard<4>, d9d::tp<2>>;

int main() { return Mesh::is_static ? 0 : 1; }
