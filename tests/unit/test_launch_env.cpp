// Launcher detection for every launcher style, and the errors for bad values.
#include <gtest/gtest.h>

#include <map>

#include "dtrain/comm/launch_env.hpp"
#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/logging.hpp"

namespace dtrain {
namespace {

LaunchEnv detect(const std::map<std::string, std::string>& vars) {
  return detect_launch_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    detect(vars);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchEnv, SingleProcessWithoutLauncher) {
  auto e = detect({});
  EXPECT_EQ(e.launcher, Launcher::kNone);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_FALSE(e.mpi_launched());
}

TEST(LaunchEnv, OpenMpi) {
  auto e = detect({{"OMPI_COMM_WORLD_RANK", "3"},
                   {"OMPI_COMM_WORLD_SIZE", "8"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                   {"RANK", "99"}});  // Open MPI wins over stray torchrun variables
  EXPECT_EQ(e.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_TRUE(e.mpi_launched());
  EXPECT_EQ(e.describe(), "Open MPI (OMPI_COMM_WORLD_*): rank 3 of 8, local rank 1 of 2");
}

TEST(LaunchEnv, Slurm) {
  auto e = detect({{"SLURM_PROCID", "5"},
                   {"SLURM_NTASKS", "16"},
                   {"SLURM_STEP_NUM_TASKS", "8"},
                   {"SLURM_LOCALID", "1"},
                   {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}});
  EXPECT_EQ(e.launcher, Launcher::kSlurm);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);  // the step's tasks, not the allocation's
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
}

TEST(LaunchEnv, Pmi) {
  auto e = detect({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"},
                   {"MPI_LOCALNRANKS", "1"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(e.launcher, Launcher::kPmi);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
}

TEST(LaunchEnv, Torchrun) {
  auto e = detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                   {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", "29500"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(e.launcher, Launcher::kTorchrun);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_FALSE(e.mpi_launched());
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
                .find("OMPI_COMM_WORLD_RANK='x' is not an integer >= 0"),
            std::string::npos);
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "0"}}).find("OMPI_COMM_WORLD_SIZE is required"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})
                .find("rank 2 is not below the world size 2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("needs MASTER_ADDR and MASTER_PORT"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000 is out of range"),
            std::string::npos);
}

TEST(LaunchEnv, IntraOpThreadsShareTheCores) {
  EXPECT_EQ(default_intra_op_threads(16, 4), 4);
  EXPECT_EQ(default_intra_op_threads(2, 4), 1);  // never zero
  EXPECT_EQ(default_intra_op_threads(8, 3), 2);
  EXPECT_EQ(default_intra_op_threads(8, 0), 8);
}

TEST(Env, ParsersNameVariableValueAndAllowed) {
  EXPECT_TRUE(env::parse_bool("X", "1"));
  EXPECT_FALSE(env::parse_bool("X", "off"));
  try {
    env::parse_bool("DTRAIN_COMM_CHECK", "maybe");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_COMM_CHECK='maybe' is not a boolean; allowed"),
              std::string::npos);
  }
  EXPECT_DOUBLE_EQ(env::parse_positive_seconds("T", "0.5"), 0.5);
  EXPECT_THROW(env::parse_positive_seconds("T", "-1"), InvalidArgument);
  EXPECT_THROW(env::parse_positive_seconds("T", "10s"), InvalidArgument);
  ::setenv(env::kCommTimeoutS, "2.5", 1);
  EXPECT_EQ(env::comm_timeout().count(), 2500);
  ::unsetenv(env::kCommTimeoutS);
  EXPECT_EQ(env::comm_timeout().count(), 600000);
  EXPECT_EQ(env::attention_kernel(), "auto");
  {
    env::ScopedOverride mma(env::kAttentionKernel, "mma");
    EXPECT_EQ(env::attention_kernel(), "mma");
    {
      env::ScopedOverride bad(env::kAttentionKernel, "fa3");
      try {
        env::attention_kernel();
        ADD_FAILURE();
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("DTRAIN_ATTENTION_KERNEL='fa3' is not a kernel; allowed: auto, mma, wgmma"),
                  std::string::npos);
      }
    }
    EXPECT_EQ(env::attention_kernel(), "mma") << "the inner override restored the outer value";
  }
  EXPECT_EQ(env::get(env::kAttentionKernel), std::nullopt) << "unset again";
}

TEST(Logging, FormatReplacesPlaceholdersInOrder) {
  EXPECT_EQ(format("a {} b {} c", 1, "x"), "a 1 b x c");
  EXPECT_EQ(format("no placeholders"), "no placeholders");
  EXPECT_EQ(format("{} only", 2.5, "extra"), "2.5 only");
  ::setenv(env::kLogLevel, "loud", 1);
  EXPECT_THROW(init_logging(0, 1), InvalidArgument);
  ::unsetenv(env::kLogLevel);
  init_logging(0, 1);
  EXPECT_TRUE(log_enabled(LogLevel::kInfo));
  init_logging(1, 2);
  EXPECT_FALSE(log_enabled(LogLevel::kInfo)) << "other ranks log warnings only";
}

}  // namespace
}  // namespace dtrain
