// Uses the installed dtrain as a user would: a runtime, the world, a mesh and a collective.
#include <ATen/ATen.h>
#include <dtrain/dtrain.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  dtrain::Runtime rt(&argc, &argv);
  dtrain::DeviceMesh mesh(rt.cpu_world(), {{"dp", rt.size()}});
  at::Tensor t = at::arange(6, at::kFloat);
  mesh.comm("dp")->all_reduce(t)->wait();
  std::printf("consumer ok: sum %g\n", t.sum().item<double>() / rt.size());
  return 0;
}
