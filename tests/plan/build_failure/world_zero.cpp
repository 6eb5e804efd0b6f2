// Build-failure test: a world size of 0 is rejected with a fix-it message.
// expect-error: d9d::world<N>: the world size must be >= 1 or d9d::dynamic
// expect-error: Fix: d9d::world<8> for 8 ranks
#include <d9d/plan/degrees.hpp>

int main() { return d9d::world<0>::value; }
