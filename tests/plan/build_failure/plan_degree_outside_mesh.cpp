// Build-failure test: a mesh degree passed to d9d::Plan directly instead of inside d9d::mesh<...>.
// expect-error: d9d::Plan: a mesh degree or d9d::world is not a plan policy
// expect-error: Fix: put it inside d9d::mesh<...>
// expect-error: e.g. d9d::Plan<d9d::mesh<d9d::tp<2>>>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::tp<2>, d9d::parallel::Replicate>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
