// Build-failure test: a dynamic degree written as the number -1 instead of d9d::dynamic.
// One degree, one type: d9d::dp_shard<d9d::dynamic> is what the mesh's inference gives.
// expect-error: d9d::dp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic
// expect-error: d9d::dp_shard<d9d::dynamic> to take it from the config
#include <d9d/plan/mesh.hpp>

using Mesh = d9d::mesh<d9d::dp_shard<-1>>;

int main() { return Mesh::dp_shard::value; }
