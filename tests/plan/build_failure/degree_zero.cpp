// Build-failure test: a mesh degree of 0 is rejected with a fix-it message.
// expect-error: d9d::tp<N>: a mesh degree must be >= 1 or d9d::dynamic
// expect-error: Fix: d9d::tp<1> for no tensor parallelism
#include <d9d/plan/degrees.hpp>

int main() { return d9d::tp<0>::value; }
