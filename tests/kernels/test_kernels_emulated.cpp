// The kernel cases (kernel_cases.hpp) on the CPU emulator of the kernels' own sources
// (kernels/emulator): the entry points of the emulated build, host tensors. Runs on every
// machine; proves the kernels' logic (indexing, masking, online softmax, reductions,
// barriers, the batching of launches), not their speed.
#define DTRAIN_KERNELS_EMULATE  // the dtrain_emu_* entry points
#include "kernel_cases.hpp"
