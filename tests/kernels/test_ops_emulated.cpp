// The op cases (op_cases.hpp) on the host: the ops' own sources (src/ops) compiled into
// this program with DTRAIN_OPS_EMULATED, so that host tensors take their kernel paths,
// over the CPU emulator of the kernels. Runs on every machine; proves the ops' code that
// otherwise runs only on a GPU (filling the params, saving for backward, autograd).
#define DTRAIN_KERNELS_EMULATE  // the dtrain_emu_* entry points
#define DTRAIN_OPS_EMULATED
#include "op_cases.hpp"
