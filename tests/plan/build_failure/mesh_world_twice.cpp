// Build-failure test: d9d::world twice in one mesh.
// expect-error: d9d::mesh: d9d::world is given more than once. Fix: give it once
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::world<8>, d9d::dp_shard<8>, d9d::world<8>>;

int main() { return Mesh::is_static ? 0 : 1; }
