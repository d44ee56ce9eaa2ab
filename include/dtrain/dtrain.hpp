// dtrain umbrella header: everything a training program needs.
#pragma once

#include "dtrain/comm/communicator.hpp"
#include "dtrain/comm/launch_env.hpp"
#include "dtrain/comm/runtime.hpp"
#include "dtrain/comm/types.hpp"
#include "dtrain/comm/work.hpp"
#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/core/logging.hpp"
#include "dtrain/data/dataset.hpp"
#include "dtrain/data/token_shard.hpp"
#include "dtrain/mesh/device_mesh.hpp"
#include "dtrain/models/gpt.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/optim/optim.hpp"
#include "dtrain/parallel/data_parallel.hpp"
