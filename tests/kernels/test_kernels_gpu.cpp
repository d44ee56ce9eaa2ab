// The kernel cases (kernel_cases.hpp) and the op cases (op_cases.hpp) on the compiled
// kernels and a CUDA device; every test skips without a GPU.
#include "kernel_cases.hpp"
#include "op_cases.hpp"
